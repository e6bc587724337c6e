"""No checkpoint runs code without --unsafe-load: every entry point, every folder kind.

The payloads are real exploits: unpickling them runs `touch SENTINEL` (through `os.system`, or
through `builtins.eval`). `test_the_payloads_run_when_unpickled_unchecked` shows that the loaders
behind each entry point (torch.load, DeepSpeed's merge, torch.distributed.checkpoint's reader)
would run them; every other test asserts they never do here: the sentinel never appears, and the
refusal is one line naming the file and the class the pickle asked for.
"""

import importlib.util
import logging
import os
import pickle
from pathlib import Path

import convert
import img2img
import pytest
import torch
import txt2img
from PIL import Image
from run_helpers import load_main

from ldm.safe_load import (
    UnsafeCheckpointError,
    allowed_global_names,
    global_names,
    read_sharded_metadata,
    sharded_metadata_global_names,
)
from lun import strategies
from lun.atomic_io import AtomicCheckpointIO

# --- payloads and the files that carry them ---------------------------------------------------


class SystemPayload:
    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch '{self.sentinel}'",))


class EvalPayload:
    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (eval, (f"__import__('os').system(\"touch '{self.sentinel}'\")",))


# The class each payload makes the pickle ask for, as the refusal names it.
ASKED_FOR = {SystemPayload: f"{os.system.__module__}.system", EvalPayload: "builtins.eval"}


@pytest.fixture(params=[SystemPayload, EvalPayload], ids=["os.system", "builtins.eval"])
def payload(request, tmp_path):
    """An object whose unpickling creates `tmp_path/SENTINEL`; checked absent after the test."""
    sentinel = tmp_path / "SENTINEL"
    made = request.param(sentinel)
    made.sentinel = sentinel
    made.asked_for = ASKED_FOR[request.param]
    yield made
    assert not sentinel.exists(), "the checkpoint's code ran"


def evil_file(path: Path, payload) -> Path:
    """A Lightning-looking .ckpt with the payload beside its weights."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 2, "hook": payload}, path)
    return path


def deepspeed_folder(root: Path, payload, where: str = "model") -> Path:
    """The layout DeepSpeed writes (as Lightning's `last.ckpt`): `latest` names the tag folder
    with the rank files; the payload in the model states or only in the optimizer states."""
    tag = root / "checkpoint"
    tag.mkdir(parents=True)
    (root / "latest").write_text("checkpoint")
    # What DeepSpeed's merge reads of the model file before it loads the optimizer files.
    clean = {
        "module": {"w": torch.ones(2)},
        "buffer_names": [],
        "param_shapes": [{"w": torch.Size([2])}],
        "shared_params": {},
        "global_step": 2,
    }
    model = {**clean, "hook": payload} if where == "model" else clean
    torch.save(model, tag / "mp_rank_00_model_states.pt")
    optim = {"optimizer_state_dict": {"w": torch.zeros(2)}}
    if where == "optim":
        optim["hook"] = payload
    torch.save(optim, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return root


def fsdp_folder(root: Path, payload, where: str = "metadata") -> Path:
    """A real torch.distributed.checkpoint folder as Lightning's sharded FSDP writes it
    (`.metadata`, `__0_0.distcp`, `meta.pt`), the payload in the `.metadata` pickle itself, in a
    non-tensor entry of the shards, or in `meta.pt`."""
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {"w": torch.ones(2)},
        "optimizer_0": {"param_groups": [{"lr": 0.1, "params": ["w"]}]},
    }
    if where == "entry":
        state["optimizer_0"]["hook"] = payload
    dcp.save(state, checkpoint_id=root, no_dist=True)
    torch.save(
        {"global_step": 2, **({"hook": payload} if where == "meta.pt" else {})}, root / "meta.pt"
    )
    if where == "metadata":
        metadata = read_sharded_metadata(root / ".metadata")
        metadata.planner_data = payload
        with open(root / ".metadata", "wb") as file:
            pickle.dump(metadata, file)
    return root


FOLDERS = [
    ("deepspeed", "model", "mp_rank_00_model_states.pt"),
    ("deepspeed", "optim", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("fsdp", "metadata", ".metadata"),
    ("fsdp", "entry", "__0_0.distcp"),
    ("fsdp", "meta.pt", "meta.pt"),
]
FOLDER_IDS = [f"{kind}-{where}" for kind, where, _ in FOLDERS]


def make_folder(root: Path, payload, kind: str, where: str) -> Path:
    return (deepspeed_folder if kind == "deepspeed" else fsdp_folder)(root, payload, where)


def assert_refused(message: str, file: Path, payload) -> None:
    """One line naming the file and the class its pickle asked for, and the way out."""
    assert len(message.strip().splitlines()) == 1, message
    assert str(file) in message and payload.asked_for in message, message
    assert "--unsafe-load" in message and "Traceback" not in message


# --- the payloads are real ----------------------------------------------------------------------


@pytest.mark.parametrize("kind, where, file", FOLDERS, ids=FOLDER_IDS)
def test_the_payloads_run_when_unpickled_unchecked(tmp_path, kind, where, file):
    """The loaders behind the entry points run each payload when nothing checks it first."""
    sentinel = tmp_path / "SENTINEL"
    folder = make_folder(tmp_path / "last.ckpt", SystemPayload(sentinel), kind, where)
    if kind == "deepspeed":  # the merge convert.py runs
        merge = pytest.importorskip("deepspeed.utils.zero_to_fp32")
        with pytest.raises(ValueError, match="not a zero checkpoint"):  # after unpickling
            merge.get_fp32_state_dict_from_zero_checkpoint(str(folder))
    elif where == "meta.pt":  # as Lightning's FSDP resume loads it given weights_only=False
        torch.load(folder / file, weights_only=False)
    elif where == "metadata":
        from torch.distributed.checkpoint import FileSystemReader

        FileSystemReader(folder).read_metadata()
    else:  # the shard entry: torch's load planner reads it with weights_only=False
        from lightning.fabric.utilities.load import _load_distributed_checkpoint

        _load_distributed_checkpoint(folder)
    assert sentinel.exists()


# --- the allow-list ---------------------------------------------------------------------------

ALLOWED = [
    "_codecs.encode",
    "argparse.Namespace",  # DiT train.py checkpoints' args, unpickled inert
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint",
    "numpy._core.multiarray.scalar",
    "numpy.core.multiarray.scalar",
    "numpy.dtype",
    "numpy.dtypes.Float32DType",
    "numpy.dtypes.Float64DType",
    "numpy.dtypes.Int32DType",
    "numpy.dtypes.Int64DType",
    "pytorch_lightning.callbacks.model_checkpoint.ModelCheckpoint",
]
SHARDED_METADATA = [
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
    "pathlib._local.PosixPath",
    "pathlib._local.PurePosixPath",
    "torch.Size",
    "torch.bfloat16",
    "torch.bool",
    "torch.complex128",
    "torch.complex64",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.float16",
    "torch.float32",
    "torch.float64",
    "torch.float8_e4m3fn",
    "torch.float8_e5m2",
    "torch.int16",
    "torch.int32",
    "torch.int64",
    "torch.int8",
    "torch.serialization._get_layout",
    "torch.uint8",
]
DEEPSPEED_RECORDS = [
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
]


def test_the_allow_lists_are_exactly_these():
    """A snapshot: widening what a checkpoint may ask for must change this test too. Beyond
    these, only torch's own weights-only set (tensors, containers, primitive values) loads."""
    assert allowed_global_names() == ALLOWED
    assert sharded_metadata_global_names() == SHARDED_METADATA
    if importlib.util.find_spec("deepspeed") is not None:
        assert global_names(strategies.checkpoint._deepspeed_records()) == DEEPSPEED_RECORDS


def test_clean_folders_pass_the_checks(tmp_path):
    """Real torch.distributed.checkpoint folders and DeepSpeed-shaped ones hold nothing refused."""
    strategies.check_checkpoint(fsdp_folder(tmp_path / "fsdp", None, where="none"))
    strategies.check_checkpoint(deepspeed_folder(tmp_path / "ds", None, where="none"))
    merged = strategies.load_training_checkpoint(tmp_path / "fsdp")
    assert torch.equal(merged["state_dict"]["w"], torch.ones(2)) and merged["global_step"] == 2


# --- the model's and the autoencoder's ckpt_path -----------------------------------------------


@pytest.fixture
def launch(tmp_path, capsys):
    """main.main(argv) in this process: (exit status, stderr lines, the run folders made)."""
    loggers = [logging.getLogger(name) for name in ("ldm", "lun")]
    saved = [(log, list(log.handlers), log.level) for log in loggers]
    main = load_main()
    logs = tmp_path / "logs"

    def run(*args: str):
        capsys.readouterr()
        status = main.main([*args, "-l", str(logs)])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error")]
        runs = list(logs.iterdir()) if logs.exists() else []
        return status, lines, err, runs

    yield run
    for log, handlers, level in saved:
        log.handlers[:] = handlers
        log.setLevel(level)


@pytest.mark.parametrize(
    "key", ["model.params.ckpt_path", "model.params.first_stage_config.params.ckpt_path"]
)
def test_ckpt_path_of_the_model_and_the_autoencoder(
    tmp_path, launch, tiny_config, shapes_dir, payload, key
):
    evil = evil_file(tmp_path / "evil.ckpt", payload)
    data = f"data.params.train.params.data_root={shapes_dir}"
    status, lines, err, runs = launch("--base", str(tiny_config), data, f"{key}={evil}")
    assert status == 2, err
    assert len(lines) == 1, err
    assert_refused(lines[0], evil, payload)
    assert runs == []  # refused before any run folder


# --- txt2img, img2img, convert ------------------------------------------------------------------


def script_exit(main, argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(argv)
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("script", [txt2img, img2img], ids=["txt2img", "img2img"])
def test_generation_scripts_refuse_code(tmp_path, capsys, tiny_config, payload, script):
    evil = evil_file(tmp_path / "evil.ckpt", payload)
    argv = ["--ckpt", str(evil), "--config", str(tiny_config), "--outdir", str(tmp_path / "out")]
    if script is img2img:
        Image.new("RGB", (32, 32)).save(tmp_path / "init.png")
        argv += ["--init-img", str(tmp_path / "init.png")]
    status, err = script_exit(script.main, argv, capsys)
    assert status == 2
    assert_refused(err, evil, payload)
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_file_with_code(tmp_path, capsys, payload):
    evil = evil_file(tmp_path / "evil.ckpt", payload)
    status, err = script_exit(convert.main, [str(evil), str(tmp_path / "out.safetensors")], capsys)
    assert status == 2
    assert_refused(err, evil, payload)
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("kind, where, file", FOLDERS, ids=FOLDER_IDS)
def test_convert_merges_refuse_folders_with_code(tmp_path, capsys, payload, kind, where, file):
    """The DeepSpeed and sharded FSDP merges: every pickle of the folder is checked first."""
    folder = make_folder(tmp_path / "last.ckpt", payload, kind, where)
    status, err = script_exit(
        convert.main, [str(folder), str(tmp_path / "out.safetensors")], capsys
    )
    assert status == 2
    assert_refused(err, next(folder.rglob(file)), payload)


def test_unsafe_load_is_the_way_to_trust_a_file(tmp_path, capsys):
    """The override works (and runs the code: that is what it is for)."""
    sentinel = tmp_path / "SENTINEL"
    evil = evil_file(tmp_path / "evil.ckpt", SystemPayload(sentinel))
    convert.main([str(evil), str(tmp_path / "out.safetensors"), "--unsafe-load"])
    assert sentinel.exists() and (tmp_path / "out.safetensors").is_file()


# --- main.py --resume: a file, each folder kind -------------------------------------------------


def test_resume_of_a_file(tmp_path, launch, tiny_config, payload):
    evil = evil_file(tmp_path / "run" / "checkpoints" / "last.ckpt", payload)
    status, lines, err, runs = launch("--base", str(tiny_config), "-r", str(evil), "-t")
    assert status == 2, err
    assert len(lines) == 1, err
    assert_refused(lines[0], evil, payload)


@pytest.mark.parametrize("kind, where, file", FOLDERS, ids=FOLDER_IDS)
def test_resume_of_each_folder_kind(tmp_path, launch, tiny_config, payload, kind, where, file):
    folder = make_folder(tmp_path / "run" / "checkpoints" / "last.ckpt", payload, kind, where)
    status, lines, err, runs = launch("--base", str(tiny_config), "-r", str(folder), "-t")
    assert status == 2, err
    assert len(lines) == 1, err
    assert_refused(lines[0], next(folder.rglob(file)), payload)


def test_unsafe_load_lets_resume_trust_the_file(
    tmp_path, launch, tiny_config, shapes_dir, monkeypatch
):
    """--unsafe-load passes the launcher's check and tells Lightning's loaders to trust the file
    (`weights_only=False`); the payload is not run here: fit is stubbed."""
    from lightning.pytorch import Trainer

    given = {}
    monkeypatch.setattr(Trainer, "fit", lambda trainer, *args, **kwargs: given.update(kwargs))
    evil = evil_file(tmp_path / "run" / "checkpoints" / "last.ckpt", SystemPayload(tmp_path / "S"))
    data = f"data.params.train.params.data_root={shapes_dir}"
    data += " lightning.trainer.max_steps=3"  # one step past the file's
    status, _, err, _ = launch(
        "--base", str(tiny_config), *data.split(), "-r", str(evil), "--unsafe-load", "-t"
    )
    assert status == 0, err
    assert given["ckpt_path"] == str(evil) and given["weights_only"] is False
    given.clear()
    status, _, err, _ = launch("--base", str(tiny_config), *data.split(), "-r", str(evil), "-t")
    assert status == 2 and given == {}  # without the flag: refused, fit never called


def test_the_trainer_refuses_a_file_without_the_launchers_check(
    tmp_path, launch, tiny_config, shapes_dir, monkeypatch
):
    """Lightning's own resume path (CheckpointIO) checks too: with main.py's check taken out."""
    sentinel = tmp_path / "SENTINEL"
    evil = evil_file(tmp_path / "run" / "checkpoints" / "last.ckpt", SystemPayload(sentinel))
    monkeypatch.setattr(strategies, "check_checkpoint", lambda *args, **kwargs: None)
    data = f"data.params.train.params.data_root={shapes_dir}"
    status, lines, err, _ = launch("--base", str(tiny_config), data, "-r", str(evil), "-t")
    assert status == 2, err
    assert "refused to unpickle" in lines[0] and str(evil) in lines[0], err  # our check's words
    assert not sentinel.exists()


# --- the strategies' and the CheckpointIO's load_checkpoint (Lightning's resume path) -----------


@pytest.mark.parametrize("kind, where, file", FOLDERS, ids=FOLDER_IDS)
def test_strategies_load_checkpoint_checks_folders(tmp_path, payload, kind, where, file):
    folder = make_folder(tmp_path / "last.ckpt", payload, kind, where)
    if kind == "deepspeed":
        pytest.importorskip("deepspeed")
    strategy = strategies.DeepSpeedStrategy() if kind == "deepspeed" else strategies.FSDPStrategy()
    with pytest.raises(UnsafeCheckpointError) as refused:
        strategy.load_checkpoint(folder)
    assert_refused(str(refused.value), next(folder.rglob(file)), payload)


def test_fsdp_strategy_and_checkpoint_io_check_files(tmp_path, payload):
    evil = evil_file(tmp_path / "last.ckpt", payload)
    for load in (strategies.FSDPStrategy().load_checkpoint, AtomicCheckpointIO().load_checkpoint):
        with pytest.raises(UnsafeCheckpointError) as refused:
            load(evil)
        assert_refused(str(refused.value), evil, payload)


def test_checkpoint_io_trusts_a_file_when_told(tmp_path):
    """`Trainer.fit(weights_only=False)` (main.py --unsafe-load) skips the check."""
    sentinel = tmp_path / "SENTINEL"
    evil = evil_file(tmp_path / "last.ckpt", SystemPayload(sentinel))
    AtomicCheckpointIO().load_checkpoint(evil, weights_only=False)
    assert sentinel.exists()
