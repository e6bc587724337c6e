"""The private Lightning names that lun uses are still there, with the signatures lun calls.

Private names (`_lazy_load`, `FSDPStrategy._setup_model`, ...) change without deprecation. Most
of their uses run only with several GPUs or on a resume, where a rename shows up as a lost run
(or, for the monkeypatched `_get_full_state_dict_context`, as a patch that silently does
nothing). These checks fail at once instead, naming the lun file to adapt. Each failure means:
adapt that file, or keep lightning inside the range of requirements.txt, which these names
were tested on.
"""

import inspect
from importlib import import_module

import lightning
import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy

STRATEGIES = "lun/strategies/"
ATOMIC_IO = "lun/atomic_io.py"
DATAMODULE = "lun/data/datamodule.py"
CHECKPOINTS = "lun/callbacks/checkpoints.py"

# (dotted name, parameter names lun calls it with - None: not called, only looked up, the lun
# file that relies on it). Overridden methods list the parameters lun's override forwards.
NAMES = [
    (
        "lightning.pytorch.strategies.DeepSpeedStrategy._init_deepspeed_distributed",
        ["self"],
        STRATEGIES,
    ),
    (
        "lightning.pytorch.strategies.DeepSpeedStrategy._setup_model_and_optimizer",
        ["self", "model", "optimizer", "lr_scheduler"],
        STRATEGIES,
    ),
    ("lightning.pytorch.strategies.DeepSpeedStrategy._multi_device", None, STRATEGIES),
    (
        "lightning.pytorch.strategies.DeepSpeedStrategy._auto_select_batch_size",
        ["self"],
        STRATEGIES,
    ),
    (
        "lightning.pytorch.strategies.DeepSpeedStrategy.save_checkpoint",
        ["self", "checkpoint", "filepath", "storage_options"],
        STRATEGIES,
    ),
    # `weights_only` arrived in lightning 2.6; the overrides pass it on positionally.
    (
        "lightning.pytorch.strategies.DeepSpeedStrategy.load_checkpoint",
        ["self", "checkpoint_path", "weights_only"],
        STRATEGIES,
    ),
    ("lightning.pytorch.strategies.FSDPStrategy._setup_model", ["self", "model"], STRATEGIES),
    (
        "lightning.pytorch.strategies.FSDPStrategy.load_checkpoint",
        ["self", "checkpoint_path", "weights_only"],
        STRATEGIES,
    ),
    (
        "lightning.pytorch.strategies.fsdp._get_full_state_dict_context",
        ["module", "world_size", "rank0_only"],
        STRATEGIES,
    ),
    (
        "lightning.fabric.strategies.fsdp._setup_activation_checkpointing",
        ["module", "activation_checkpointing_kwargs"],
        STRATEGIES,
    ),
    ("lightning.fabric.utilities.load._lazy_load", ["filename"], STRATEGIES),
    ("lightning.fabric.utilities.load._materialize_tensors", ["collection"], STRATEGIES),
    (
        "lightning.fabric.utilities.load._load_distributed_checkpoint",
        ["checkpoint_folder"],
        STRATEGIES,
    ),
    (
        "lightning.pytorch.plugins.precision.FSDPPrecision.__init__",
        ["self", "precision", "scaler"],
        STRATEGIES,
    ),
    ("lightning.fabric.utilities.cloud_io._is_local_file_protocol", ["path"], ATOMIC_IO),
    (
        "lightning.fabric.plugins.TorchCheckpointIO.save_checkpoint",
        ["self", "checkpoint", "path", "storage_options"],
        ATOMIC_IO,
    ),
    (
        "lightning.pytorch.callbacks.ModelCheckpoint._monitor_candidates",
        ["self", "trainer"],
        CHECKPOINTS,
    ),
    (
        "lightning.pytorch.callbacks.ModelCheckpoint._generate_state_key",
        ["self", "kwargs"],
        CHECKPOINTS,
    ),
    (
        "lightning.pytorch.callbacks.ModelCheckpoint._link_checkpoint",
        ["trainer", "filepath", "linkpath"],
        CHECKPOINTS,
    ),
    ("lightning.pytorch.utilities.exceptions.SIGTERMException", None, "lun/callbacks/signals.py"),
]


def lightning_failure(user: str, what: str) -> str:
    return (
        f"{user} relies on {what} (lightning {lightning.__version__}): adapt {user}, "
        "or keep lightning in the range of requirements.txt"
    )


def look_up(dotted: str):
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = inspect.getattr_static(obj, attr)  # static: a property is not run
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("dotted, params, user", NAMES, ids=[n[0] for n in NAMES])
def test_private_name_exists_with_the_called_signature(dotted, params, user):
    try:
        obj = look_up(dotted)
    except (ImportError, AttributeError) as err:
        pytest.fail(lightning_failure(user, f"{dotted}, which is gone ({err!r})"))
    if params is None:
        return
    found = list(inspect.signature(obj).parameters)
    assert found == params, lightning_failure(user, f"{dotted}({', '.join(params)}), now {found}")


@pytest.mark.parametrize(
    "method", ["lightning_module_state_dict", "optimizer_state", "load_checkpoint"]
)
def test_fsdp_methods_read_the_patched_state_dict_context(method):
    """lun swaps the module global `_get_full_state_dict_context` for CPU runs (Lightning's
    offloads, which segfaults on CPU shards): the methods must look that global up by name."""
    code = getattr(FSDPStrategy, method).__code__
    assert "_get_full_state_dict_context" in code.co_names, lightning_failure(
        STRATEGIES, f"FSDPStrategy.{method} calling the module's _get_full_state_dict_context"
    )


def test_fsdp_strategy_instance_attributes():
    """`FSDPStrategy._setup_model` on CPU rebuilds Lightning's wrapping from these attributes."""
    strategy = FSDPStrategy()
    for name in (
        "_activation_checkpointing_kwargs",
        "kwargs",
        "cpu_offload",
        "sharding_strategy",
        "mixed_precision_config",
    ):
        assert hasattr(strategy, name), lightning_failure(STRATEGIES, f"FSDPStrategy().{name}")


@pytest.mark.parametrize("use_distributed_sampler", [False, True])
def test_trainer_internals_the_datamodule_reads(use_distributed_sampler):
    """The DataModule reads them through getattr defaults: a rename would pass silently."""
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        use_distributed_sampler=use_distributed_sampler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    connector = getattr(trainer, "_accelerator_connector", None)
    assert getattr(connector, "use_distributed_sampler", None) is use_distributed_sampler, (
        lightning_failure(DATAMODULE, "trainer._accelerator_connector.use_distributed_sampler")
    )
    try:
        position = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    except AttributeError as err:
        pytest.fail(lightning_failure(DATAMODULE, f"fit_loop...current.processed ({err!r})"))
    assert position == 0


def test_seed_everything_publishes_pl_global_seed():
    """The DataModule seeds its workers from $PL_GLOBAL_SEED (default 0) when given no seed."""
    from lightning.fabric.utilities.seed import seed_everything

    assert "PL_GLOBAL_SEED" in inspect.getsource(seed_everything), lightning_failure(
        DATAMODULE, "seed_everything setting $PL_GLOBAL_SEED"
    )


def test_model_checkpoint_trigger_attributes():
    """`state_key` of lun's checkpoint callback is built from these."""
    callback = ModelCheckpoint(every_n_train_steps=5)
    for name in ("_every_n_train_steps", "_every_n_epochs", "_train_time_interval"):
        assert hasattr(callback, name), lightning_failure(CHECKPOINTS, f"ModelCheckpoint().{name}")
    assert callback._every_n_train_steps == 5, lightning_failure(
        CHECKPOINTS, "ModelCheckpoint()._every_n_train_steps holding every_n_train_steps"
    )


def test_trainer_says_whether_this_step_logs():
    """ldm/model_contract.py logs (host reads) only on logging steps, as
    `trainer._logger_connector.should_update_logs` says; a rename would raise on every step."""
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    connector = getattr(trainer, "_logger_connector", None)
    flag = getattr(connector, "should_update_logs", None)
    assert isinstance(flag, bool), lightning_failure(
        "ldm/model_contract.py", "trainer._logger_connector.should_update_logs"
    )
