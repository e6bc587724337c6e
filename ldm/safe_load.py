"""Reading weights files safely: `.safetensors`, torch pickles with a short allow-list, and the
folders of sharded FSDP checkpoints (torch.distributed.checkpoint).

The bottom of the weights stack: it knows files, not names. `ldm.layout` (which names a file's
keys hold) and `ldm.checkpoint` (loading them into a model) build on it; it imports neither.
"""

import errno
import io
import pickle
import pickletools
import re
import warnings
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A pickled checkpoint that needs a class outside the allow-list."""


class UnreadableCheckpointError(pickle.UnpicklingError, ValueError):
    """A damaged or foreign weights file (cut short, random bytes, empty). A ValueError, as every
    script's one-line handler takes it; an UnpicklingError too, so that a launcher that reports
    refused pickles in one line (main.py's `--resume` check) reports a broken one the same way."""


class _InertObject:
    """Stands in for harmless bookkeeping objects that original checkpoints pickled (e.g. the
    Lightning ModelCheckpoint callback): unpickled as plain attribute bags, never executed."""

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


def _numpy_globals() -> list:
    import numpy as np

    scalar = np.core.multiarray.scalar if hasattr(np, "core") else np._core.multiarray.scalar
    found = [
        scalar,
        np.dtype,
        *(type(np.dtype(t)) for t in ("float32", "float64", "int64", "int32")),
    ]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        found.append((scalar, f"{module}.scalar"))
    return found


# What released SD checkpoints and Lightning checkpoints contain besides tensors and builtins.
_INERT_NAMES = (
    "argparse.Namespace",  # the `args` of DiT's train.py checkpoints
    "pytorch_lightning.callbacks.model_checkpoint.ModelCheckpoint",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint",
)


def _allowed_globals() -> list:
    import codecs

    return [*_numpy_globals(), codecs.encode, *((_InertObject, name) for name in _INERT_NAMES)]


def global_names(entries: Iterable) -> list[str]:
    """The names under which `torch.serialization.safe_globals` entries admit classes."""
    return sorted(
        {e[1] if isinstance(e, tuple) else f"{e.__module__}.{e.__qualname__}" for e in entries}
    )


def allowed_global_names() -> list[str]:
    """What pickles may ask for beyond torch's own weights-only set (pinned by a test)."""
    return global_names(_allowed_globals())


def _refusal(path, err: Exception, what: str = "") -> UnsafeCheckpointError:
    """The one-line error for a pickle that asked for a class outside the allow-list."""
    text = str(err)
    found = re.search(r"GLOBAL (\S+)", text) or re.search(r"asks for (\S+)", text)
    if found:
        # torch names builtins without their module ("GLOBAL eval").
        detail = "it asks for " + (found[1] if "." in found[1] else f"builtins.{found[1]}")
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        detail = next((line for line in lines if "WeightsUnpickler" in line), lines[0])
    return UnsafeCheckpointError(
        f"{path}{what}: refused to unpickle ({detail}); this file holds code, not just weights. "
        "Convert it to .safetensors, or pass --unsafe-load if you trust its source."
    )


def _unreadable(path, err: Exception | str) -> UnreadableCheckpointError:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    first = lines[0] if lines else "it ends too early"  # EOFError()
    return UnreadableCheckpointError(
        f"{path}: not a readable checkpoint ({first}); is the file complete?"
    )


def pickled_globals(source) -> list[str] | None:
    """The classes and functions a plain pickle names (GLOBAL, STACK_GLOBAL), read by
    `pickletools` without running anything; None when the bytes are no whole pickle (random
    bytes, a cut file). Only the first pickle of the stream is read."""
    names, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(source):
            if op.name == "GLOBAL":
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except (ValueError, EOFError, UnicodeDecodeError):
        return None
    return names


def _unsupported_opcode(path, err: pickle.UnpicklingError, what: str) -> Exception:
    """torch's "Unsupported operand N": either no pickle at all (random bytes named .ckpt) or a
    pickle torch's weights-only reader cannot walk (Python's protocol 4 and 5 `pickle.dump`).
    The latter is refused with the names it asks for, read by `pickled_globals`."""
    names = None
    if isinstance(path, Path) and path.is_file() and not zipfile.is_zipfile(path):
        with open(path, "rb") as file:
            names = pickled_globals(file)
    if names is None:
        return _unreadable(f"{path}{what}", "not a torch checkpoint: no pickle in it")
    if names:
        return _refusal(path, ValueError(f"asks for {names[0]}"), what)
    return _unreadable(f"{path}{what}", "a pickle that torch's weights-only loader cannot read")


def _torch_load(source, path, *, weights_only: bool, **kwargs):
    """torch.load; a zip file cut short (torch: "[Errno 22] Invalid argument", naming nothing)
    is a ValueError naming `path`."""
    with warnings.catch_warnings():
        # "Detected pickle protocol 4 in the checkpoint": its failure, if any, is ours to say.
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        try:
            return torch.load(source, map_location="cpu", weights_only=weights_only, **kwargs)
        except OSError as err:
            if err.filename is not None or err.errno != errno.EINVAL:
                raise
            raise _unreadable(path, "a zip archive cut short") from None


def _weights_only_load(source, path, extra_globals: Iterable = (), what: str = "", **kwargs):
    """torch.load(weights_only=True) with the allow-list; refusals and damage name `path`."""
    try:
        with torch.serialization.safe_globals([*_allowed_globals(), *extra_globals]):
            return _torch_load(source, path, weights_only=True, **kwargs)
    except UnreadableCheckpointError:
        raise
    except pickle.UnpicklingError as err:
        if "Unsupported operand" in str(err):
            raise _unsupported_opcode(path, err, what) from None
        raise _refusal(path, err, what) from None
    except (RuntimeError, EOFError, KeyError, zipfile.BadZipFile) as err:
        # A truncated or foreign file: torch says "failed finding central directory",
        # "unexpected EOF" or KeyError(<first byte>), none of which names the file.
        raise _unreadable(path, err) from None


def check_pickle(path: str | Path, extra_globals: Iterable = ()) -> None:
    """Refuse (UnsafeCheckpointError) a torch pickle that needs a class outside the allow-list
    (plus `extra_globals`). Loaded weights-only and dropped, memory-mapped where the format
    allows, so checking a file before a loader that unpickles it fully costs little."""
    path = Path(path)
    if path.suffix != ".safetensors":  # holds no pickle
        _weights_only_load(path, path, extra_globals, mmap=zipfile.is_zipfile(path))


def check_readable(path: str | Path) -> None:
    """A weights file that will be loaded later, checked now at little cost: a `.safetensors`
    header against the file's size (memory-mapped by safetensors, no tensor read), a pickle
    weights-only (`check_pickle`). Damage and refusals raise as `load_file_state` would."""
    path = Path(path)
    if path.is_file():
        _check_not_empty(path)
    if path.suffix != ".safetensors":
        check_pickle(path)
        return
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as err:
        raise _unreadable_safetensors(path, err) from None


def _check_not_empty(path: Path) -> None:
    """An empty file is said as such (safetensors says "header too small", torch "EOFError()")."""
    if path.stat().st_size == 0:
        raise UnreadableCheckpointError(
            f"{path}: an empty file (0 bytes); download or copy it again"
        )


def _unreadable_safetensors(path, err: Exception) -> UnreadableCheckpointError:
    # "incomplete metadata, file not fully covered", "header too large", ...
    return UnreadableCheckpointError(f"{path}: not a readable .safetensors file ({err})")


def load_file_state(
    path: str | Path, unsafe: bool = False, extra_globals: Iterable = (), mmap: bool = False
) -> dict:
    """The raw contents of a `.safetensors` file or a torch pickle (`.ckpt`, `.pt`, `.bin`).

    Pickles load with `weights_only=True` and a short allow-list (plus `extra_globals`); a
    checkpoint that needs any other class is refused with its name unless `unsafe=True` (only
    for files you trust). A damaged file raises ValueError naming it. `mmap`: the tensors of a
    torch zip file are memory-mapped, read from the file when used.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    _check_not_empty(path)
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except SafetensorError as err:
            raise _unreadable_safetensors(path, err) from None
    mmap = mmap and zipfile.is_zipfile(path)  # the legacy format cannot be mapped
    if unsafe:
        try:
            return _torch_load(path, path, weights_only=False, mmap=mmap)
        except UnreadableCheckpointError:
            raise
        except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile) as err:
            raise _unreadable(path, err) from None  # "invalid load key, 'D'."
    return _weights_only_load(path, path, extra_globals, mmap=mmap)


# --- torch.distributed.checkpoint folders (sharded FSDP) ------------------------------------
# Their `.metadata` is a plain pickle (protocol 4, which torch's weights-only unpickler cannot
# read) that FileSystemReader loads with `pickle.load`: it is checked by an unpickler that
# resolves only these names. Non-tensor entries of the `*.distcp` files are torch pickles that
# the default load planner reads with `weights_only=False`: each is checked weights-only first.
SHARDED_DTYPES = (
    "bfloat16",
    "bool",
    "complex128",
    "complex64",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int16",
    "int32",
    "int64",
    "int8",
    "uint8",
)


def _sharded_metadata_globals() -> dict[str, object]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    found = {f"torch.{name}": getattr(torch, name) for name in SHARDED_DTYPES}
    found["torch.Size"] = torch.Size
    found["torch.serialization._get_layout"] = torch.serialization._get_layout
    found["torch.distributed.checkpoint.filesystem._StorageInfo"] = filesystem._StorageInfo
    for name in (
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    ):
        found[f"torch.distributed.checkpoint.metadata.{name}"] = getattr(metadata, name)
    # StorageMeta.checkpoint_id: the folder it was written to (pathlib._local from Python 3.13).
    for module in ("pathlib", "pathlib._local"):
        found[f"{module}.PosixPath"] = pathlib.PosixPath
        found[f"{module}.PurePosixPath"] = pathlib.PurePosixPath
    return found


def sharded_metadata_global_names() -> list[str]:
    """What a sharded checkpoint's `.metadata` may ask for (pinned by a test)."""
    return sorted(_sharded_metadata_globals())


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the names of `_sharded_metadata_globals`: every class or function a pickle
    can call is looked up here, so nothing else can run (the stdlib's "restricting globals")."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path
        self.allowed = _sharded_metadata_globals()

    def find_class(self, module: str, name: str):
        found = self.allowed.get(f"{module}.{name}")
        if found is None:
            raise _refusal(self.path, ValueError(f"asks for {module}.{name}"))
        return found

    def persistent_load(self, pid):
        raise _refusal(self.path, ValueError(f"asks for persistent id {pid!r}"))


def read_sharded_metadata(path: str | Path):
    """The `Metadata` of a `.metadata` file, unpickled with only its own classes resolvable."""
    path = Path(path)
    with open(path, "rb") as file:
        try:
            return _MetadataUnpickler(file, path).load()
        except UnsafeCheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
            raise _unreadable(path, err) from None


def check_sharded_folder(folder: str | Path, extra_globals: Iterable = ()) -> None:
    """Refuse (UnsafeCheckpointError) a torch.distributed.checkpoint folder (Lightning's sharded
    FSDP checkpoint) with anything outside the allow-list: its `.metadata` files, the non-tensor
    entries of its shards (tensor entries torch loads weights-only itself), its `*.pt` files."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    for meta in sorted(p for p in folder.iterdir() if p.name.endswith(".metadata")):
        metadata = read_sharded_metadata(meta)
        entries = getattr(metadata, "state_dict_metadata", None) or {}
        for index, info in (getattr(metadata, "storage_data", None) or {}).items():
            if not isinstance(entries.get(getattr(index, "fqn", None)), BytesStorageMetadata):
                continue
            shard = folder / info.relative_path
            with open(shard, "rb") as file:
                file.seek(info.offset)
                stream = io.BytesIO(file.read(info.length))
            if info.transform_descriptors:  # e.g. compressed: undone as the reader would
                from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms

                stream = io.BytesIO(
                    _StorageReaderTransforms()
                    .transform_load_stream(None, info.transform_descriptors, stream)
                    .read()
                )
            _weights_only_load(stream, shard, extra_globals, what=f" (entry '{index.fqn}')")
    for pt in sorted(folder.glob("*.pt")):
        check_pickle(pt, extra_globals)


def state_dict_of(contents: Mapping) -> dict[str, torch.Tensor]:
    """The flat state dict inside a checkpoint (Lightning/original `{"state_dict": ...}` or flat)."""
    state = contents.get("state_dict", contents)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
