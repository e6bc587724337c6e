"""What `main.py --resume` refuses before the run folder takes the config: a checkpoint whose
tensors do not fit the model the config builds, and a run with no step left to train."""

import lightning.pytorch as pl
import torch
from torch import nn

from lun.run import nothing_left_problem
from lun.strategies import shape_problem


class Tiny(pl.LightningModule):
    def __init__(self, width: int, renamed: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, width), nn.Linear(width, 2))
        self.renamed = renamed

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # As a LoRA run's hook: the file's names are put in the module's before they are read.
        if self.renamed:
            state = checkpoint["state_dict"]
            for key in list(state):
                state[key.replace("saved.", "body.")] = state.pop(key)


def saved(tmp_path, module: nn.Module, step: int = 5, rename: bool = False):
    state = module.state_dict()
    if rename:
        state = {k.replace("body.", "saved."): v for k, v in state.items()}
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": state, "global_step": step, "optimizer_states": []}, path)
    return path


def test_a_tensor_of_another_shape_is_named_with_both_shapes(tmp_path):
    path = saved(tmp_path, Tiny(4))
    assert shape_problem(path, Tiny(4)) is None
    line = shape_problem(path, Tiny(8))
    assert line.startswith(f"--resume: {path} holds body.0.weight as 4x3, this config builds 8x3")
    assert "(and 2 more)" in line  # body.0.bias, body.1.weight
    assert "\n" not in line


def test_the_modules_own_names_are_compared(tmp_path):
    # A file in another layout than the module (a LoRA run's) is read through the module's hook:
    # without it no name would match and nothing would be compared.
    path = saved(tmp_path, Tiny(4), rename=True)
    assert "body.0.weight as 4x3" in shape_problem(path, Tiny(8, renamed=True))
    assert shape_problem(path, Tiny(4, renamed=True)) is None


def test_folders_are_left_to_their_engines(tmp_path):
    assert shape_problem(tmp_path, Tiny(4)) is None


def test_nothing_left_to_train(tmp_path):
    path = saved(tmp_path, Tiny(4), step=5)
    assert nothing_left_problem(path, max_steps=6, max_epochs=None) is None
    assert nothing_left_problem(path, max_steps=-1, max_epochs=-1) is None  # no limit
    for max_steps in (5, 3):
        line = nothing_left_problem(path, max_steps, max_epochs=None)
        assert line.startswith(f"lightning.trainer.max_steps: {max_steps}, but {path} is at step 5")
        assert "N above 5" in line


def test_nothing_left_to_train_by_epochs(tmp_path):
    # What Lightning's fit loop compares with max_epochs (fit_loop.py `done`): the epochs
    # `processed`, which the save at an epoch's end has counted and `completed` not yet.
    path = tmp_path / "last.ckpt"
    progress = {"current": {"ready": 2, "started": 2, "processed": 2, "completed": 1}}
    loops = {"fit_loop": {"epoch_progress": progress}}
    torch.save({"state_dict": {}, "global_step": 6, "loops": loops}, path)
    assert nothing_left_problem(path, max_steps=-1, max_epochs=3) is None
    line = nothing_left_problem(path, max_steps=-1, max_epochs=2)
    assert line.startswith(f"lightning.trainer.max_epochs: 2, but {path} has trained 2 epoch")
    assert nothing_left_problem(path, max_steps=100, max_epochs=2) is not None  # either limit
