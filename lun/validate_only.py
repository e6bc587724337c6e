"""`main.py --validate-only`: the fixed-noise validation loss (ldm.validation) of a checkpoint,
without training and without writing into its run folder.

    python main.py --validate-only logs/<run>                   # its newest checkpoint, its configs
    python main.py --base cfg.yaml --validate-only model.ckpt --out figures.json

The weights are the checkpoint's EMA weights when it has them (what a run validates with the
default `EMA(validate_with_ema=True)`), else its raw ones; `--raw-weights` takes the raw ones. The
figures are what the model logs in validation, as a training run logs them at that step (for
LatentDiffusion `val/loss`, one per timestep bucket and `val/items`, ldm/validation.py).
"""

import json
import logging
from pathlib import Path

from lun.config import ConfigError

log = logging.getLogger(__name__)


def validation_table(figures: dict[str, float], source: str) -> str:
    """The validation figures as lines, in the order the model logged them (6 digits)."""
    lines = [f"validation of {source}"]
    width = max(len(name) for name in figures)
    for name, value in figures.items():
        lines.append(f"  {name:<{width}}  {value:.6g}")
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

    from ldm.checkpoint import load_weights
    from ldm.layout.ema import has_ema
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
    (metrics,) = trainer.validate(model, datamodule=data, verbose=False)
    if not is_rank_zero():
        return 0
    figures = {name: float(value) for name, value in metrics.items()}
    print(validation_table(figures, weights))
    if out is not None:
        record = {
            "checkpoint": str(ckpt_path) if ckpt_path else None,
            "weights": weights,
            "figures": figures,
        }
        Path(out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")
    return 0
