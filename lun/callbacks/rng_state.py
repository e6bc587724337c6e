"""Random-number streams in every checkpoint, one set per rank, put back on resume.

Without them a resumed run draws its timesteps, noise and caption dropout from the launcher's
fresh seed - the first steps' numbers again - and ends up somewhere else than the run that was
never stopped.
"""

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lun import rng


class RNGState(Callback):
    """Saves the `random`, numpy, torch CPU and accelerator generator states of every rank, and
    restores each rank's own when training resumes.

    Lightning writes the callback states of rank 0 only, so saving gathers all ranks' states
    (every rank saves together: `Trainer.save_checkpoint` is collective) into one table, from
    which each rank takes its row on resume. The states are tensors, so checkpoints still load
    with `torch.load(weights_only=True)`.
    """

    def __init__(self):
        self._trainer = None
        self._loaded: dict | None = None  # from the checkpoint, put back when training starts

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict:
        trainer = self._trainer
        if trainer is None:
            return {}
        device = trainer.strategy.root_device
        states = {}
        for name, tensor in rng.capture(device).items():
            if trainer.world_size == 1:
                states[name] = tensor.unsqueeze(0)
            else:  # (world_size, ...); on the device the process group talks through
                states[name] = trainer.strategy.all_gather(tensor.to(device)).cpu()
        return {"world_size": trainer.world_size, "states": states}

    def load_state_dict(self, state_dict: dict) -> None:
        self._loaded = state_dict

    def on_train_start(self, trainer, pl_module) -> None:
        # Here, not when the checkpoint is read: after the sanity check, model set-up and
        # strategy set-up, so nothing that runs only at start draws from the restored streams.
        # Between here and the first training step only data loading happens, and that runs
        # under its own streams (lun.rng.seeded).
        loaded, self._loaded = self._loaded, None
        if trainer.ckpt_path is None:
            return
        if not loaded:
            rank_zero_warn(
                "the checkpoint carries no random-number states (written by an older version): "
                "the streams restart from the seed, so this resume is not bitwise exact"
            )
            return
        if loaded["world_size"] != trainer.world_size:
            rank_zero_warn(
                f"the checkpoint's random-number states are of {loaded['world_size']} processes, "
                f"this run has {trainer.world_size}: the streams restart from the seed"
            )
            return
        rank = trainer.global_rank
        # A copy of the row: torch's set_rng_state misreads a view into a larger tensor.
        own = {name: table[rank].clone() for name, table in loaded["states"].items()}
        rng.restore(own, trainer.strategy.root_device)
        rank_zero_info("random-number streams restored from the checkpoint")
