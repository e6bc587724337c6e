"""`main.py --validate-only`: the fixed-noise validation loss (ldm.validation) of a checkpoint,
without training and without writing into its run folder.

    python main.py --validate-only logs/<run>                   # its newest checkpoint, its configs
    python main.py --base cfg.yaml --validate-only model.ckpt --out figures.json

The weights are the checkpoint's EMA weights when it has them (what a run validates with the
default `EMA(validate_with_ema=True)`), else its raw ones; `--raw-weights` takes the raw ones. The
figures are those a training run logs at that step: `val/loss` and one per timestep bucket.
"""

import json
import logging
from pathlib import Path

from lun.config import ConfigError

log = logging.getLogger(__name__)


def validation_table(figures: dict[str, float], items: int, source: str) -> str:
    """The figures as lines: the overall mean, then one line per timestep bucket."""
    lines = [f"validation loss of {source}, {items} items (fixed timesteps and noise per item)"]
    width = max(len(name) for name in figures)
    for name, value in figures.items():
        lines.append(f"  {name:<{width}}  {value:.6f}")
    return "\n".join(lines)


def validate_checkpoint(
    model,
    data,
    lightning_cfg: dict,
    ckpt_path: Path | None,
    out: str | None = None,
    raw_weights: bool = False,
    unsafe: bool = False,
) -> int:
    """Load `ckpt_path` into the built `model` (none: the weights the config builds), run the
    validation split of `data` on the config's accelerator, devices and precision (no logger, no
    callbacks, no checkpoint), print the table and write it to `out` as JSON when given."""
    from lightning.pytorch import Trainer

    from ldm.checkpoint import has_ema, load_weights
    from lun.run import is_rank_zero
    from lun.trainer import trainer_kwargs

    if getattr(data, "configs", {}).get("validation") is None:
        raise ConfigError(
            "--validate-only: the config has no data.params.validation (a held-out image set)"
        )
    if out is not None and not Path(out).parent.is_dir():
        raise ConfigError(f"--out: the folder of '{out}' does not exist")
    weights = "the config's weights"
    if ckpt_path is not None:
        try:
            state = load_weights(
                model, ckpt_path, ema=False if raw_weights else None, unsafe=unsafe
            )
        except (KeyError, ValueError, OSError) as err:  # not weights of this config's model
            message = str(err.args[0] if isinstance(err, KeyError) else err).splitlines()[0]
            raise ConfigError(f"--validate-only: {message}") from None
        used_ema = not raw_weights and has_ema(state)
        weights = f"{ckpt_path} ({'EMA' if used_ema else 'raw'} weights)"
    kwargs = trainer_kwargs(lightning_cfg)
    # Validation needs no sharded optimizer state: the default strategy for the device count.
    kwargs.pop("strategy", None)
    kwargs.update(logger=False, callbacks=[], enable_checkpointing=False)
    kwargs["enable_model_summary"] = False
    trainer = Trainer(**kwargs)
    trainer.validate(model, datamodule=data, verbose=False)
    figures = model.validation_loss.last
    if not is_rank_zero():
        return 0
    print(validation_table(figures, model.validation_loss.items, weights))
    if out is not None:
        record = {
            "checkpoint": str(ckpt_path) if ckpt_path else None,
            "weights": weights,
            "items": model.validation_loss.items,
            "figures": figures,
        }
        Path(out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")
    return 0
