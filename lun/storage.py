"""Files on object storage (`s3://`, `gs://`, any fsspec URL): reaching them, listing them, and a
size-bounded local cache of what was read.

Credentials come only from the places each SDK reads itself (for S3: `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY` / `AWS_PROFILE` / `AWS_ENDPOINT_URL`, `~/.aws/credentials`, the instance
role; for GCS: `GOOGLE_APPLICATION_CREDENTIALS`, gcloud's login); a URL carrying them is refused,
so they never reach a saved config. Every problem here is a `StorageError` (a ValueError: the
launcher reports it in one line, exit status 2, before a run folder exists).

Light on purpose (fsspec, no torch).
"""

import contextlib
import hashlib
import logging
import os
import re
import time
import uuid

from lun.config import ConfigError

log = logging.getLogger(__name__)

# The package each protocol needs beside fsspec, named when it is missing.
PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
}
_URL = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$")
# A file read a moment ago is never evicted: a DataLoader worker may be about to open it.
EVICT_GRACE_S = 60.0


class StorageError(ConfigError):
    """Object storage cannot be used as asked; the message is one line naming the URL (a
    ConfigError, so a ValueError: the launcher's one-line error, exit status 2)."""


def is_url(path) -> bool:
    """`s3://bucket/key`, `gs://...`, `file:///...`: a path for fsspec (`pipe:` is not)."""
    return isinstance(path, str) and _URL.match(path) is not None


def protocol(url: str) -> str:
    return _URL.match(url)["protocol"].lower()


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def filesystem(url: str):
    """(fsspec filesystem, path without the protocol) of `url`; StorageError when its package is
    missing or the URL carries credentials."""
    match = _URL.match(url)
    if match is None:
        raise StorageError(f"{url}: not a URL (expected e.g. s3://bucket/prefix)")
    netloc = match["rest"].split("/", 1)[0]
    if "@" in netloc:
        raise StorageError(
            f"{protocol(url)}://{netloc.split('@')[-1]}/...: credentials in the URL are refused "
            "(they would be saved with the config); use the environment or the SDK's config files"
        )
    try:
        import fsspec

        # A local folder (file://) needs its sub-folders made; object stores have none to make.
        options = {"auto_mkdir": True} if protocol(url) in ("file", "local") else {}
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as err:
        package = PACKAGES.get(protocol(url)) or str(err)
        raise StorageError(
            f"{url}: {protocol(url)}:// needs {package}: pip install {package}"
        ) from None
    except ValueError as err:  # fsspec: "Protocol not known"
        raise StorageError(f"{url}: {err}") from None


def describe_error(url: str, err: Exception) -> str:
    """One line for what reaching `url` raised: missing credentials, bucket, or permission."""
    name = type(err).__name__
    if "credential" in name.lower() or "credential" in str(err).lower():
        where = {
            "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or ~/.aws/credentials",
            "gs": "GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login`",
        }.get(protocol(url).rstrip("a").replace("gcs", "gs"), "the SDK's usual places")
        return f"{url}: no credentials found (set {where})"
    if isinstance(err, FileNotFoundError):
        return f"{url}: the bucket does not exist ({err})"
    if isinstance(err, PermissionError):
        return f"{url}: access denied ({err})"
    return f"{url}: cannot reach it: {name}: {str(err).splitlines()[0] if str(err) else ''}"


def check_reachable(url: str):
    """(fs, path) of `url` once its bucket answers a listing; StorageError otherwise."""
    fs, path = filesystem(url)
    bucket = "/" if path.startswith("/") else path.split("/", 1)[0]
    try:
        fs.ls(bucket, refresh=True)
    except Exception as err:  # the SDKs' errors share no base class
        raise StorageError(describe_error(url, err)) from None
    return fs, path


def version(info: dict) -> str:
    """A short token that changes when an object's content does (its ETag, generation or time)."""
    for key in ("ETag", "etag", "generation", "md5Hash", "LastModified", "mtime", "created"):
        if info.get(key) is not None:
            return hashlib.sha1(str(info[key]).encode()).hexdigest()[:12]
    return str(info.get("size", ""))


def list_files(url: str) -> list[tuple[str, int, str]]:
    """(path relative to `url` with "/" separators, size, version) of each object under it, sorted
    (as lun.data.index.walk lists a folder; hidden names are left out the same way)."""
    fs, root = check_reachable(url)
    root = root.rstrip("/")
    try:
        found = fs.find(root, detail=True)
    except Exception as err:
        raise StorageError(describe_error(url, err)) from None
    listing = []
    for name, info in found.items():
        rel = name[len(root) :].lstrip("/")
        if (
            info.get("type") == "file"
            and rel
            and not any(p.startswith(".") for p in rel.split("/"))
        ):
            listing.append((rel, int(info.get("size") or 0), version(info)))
    return sorted(listing)


def file_cache_dir() -> str:
    """$LUN_FILE_CACHE, else $XDG_CACHE_HOME/lun/files, else ~/.cache/lun/files."""
    if os.environ.get("LUN_FILE_CACHE"):
        return os.environ["LUN_FILE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lun", "files")


def file_cache_bytes() -> int:
    """The cache's size bound: $LUN_FILE_CACHE_GB gigabytes (default 20)."""
    return int(float(os.environ.get("LUN_FILE_CACHE_GB", "20")) * 1e9)


class FileCache:
    """Local copies of remote files, evicted least recently used first above `max_bytes`.

    A copy is named by the object's URL and version, so a rewritten object is fetched again; it
    is downloaded under a temporary name and renamed when whole (size checked), so a reader or a
    killed download never sees part of a file. Several processes (DataLoader workers, ranks) may
    share the folder: each evicts by the files' last use (mtime, set on every use).
    """

    def __init__(self, folder: str | None = None, max_bytes: int | None = None):
        self.folder = folder or file_cache_dir()
        self.max_bytes = file_cache_bytes() if max_bytes is None else max_bytes

    def local_path(self, url: str, info: dict | None = None) -> str:
        """The local copy of `url` (fetched now if needed); `info`: its listing entry
        {"size", version keys}, asked of the store when not given."""
        fs, path = filesystem(url)
        if info is None:
            info = fs.info(path)
        size = int(info.get("size") or 0)
        local = os.path.join(self.folder, protocol(url), f"{path}.{version(info)}")
        if os.path.isfile(local) and os.path.getsize(local) == size:
            with contextlib.suppress(OSError):
                os.utime(local)  # used now: last in line for eviction
            return local
        os.makedirs(os.path.dirname(local), exist_ok=True)
        self.evict(need=size)
        temporary = f"{local}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            fs.get_file(path, temporary)
            got = os.path.getsize(temporary)
            if got != size:
                raise OSError(f"{url}: downloaded {got} bytes, the store lists {size}")
            os.replace(temporary, local)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)
        return local

    def evict(self, need: int = 0) -> None:
        """Delete the least recently used copies until `need` more bytes fit under the bound."""
        files = []
        for folder, _, names in os.walk(self.folder):
            for name in names:
                with contextlib.suppress(OSError):
                    stat = os.stat(os.path.join(folder, name))
                    files.append((stat.st_mtime, stat.st_size, os.path.join(folder, name)))
        total = sum(size for _, size, _ in files)
        now = time.time()
        for used, size, path in sorted(files):
            if total + need <= self.max_bytes or now - used < EVICT_GRACE_S:
                break
            with contextlib.suppress(OSError):
                os.remove(path)
                total -= size


def object_infos(urls: list[str]) -> dict[str, dict]:
    """{url: listing entry} of those of `urls` that exist, one listing per folder (a shard list
    of thousands costs a few requests, not thousands)."""
    folders: dict[str, list[str]] = {}
    for url in urls:
        folders.setdefault(url.rsplit("/", 1)[0], []).append(url)
    found = {}
    for folder, members in folders.items():
        fs, path = check_reachable(folder)
        try:
            listed = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in fs.ls(path, detail=True)}
        except FileNotFoundError:
            continue
        except Exception as err:
            raise StorageError(describe_error(folder, err)) from None
        for url in members:
            entry = listed.get(url.rsplit("/", 1)[-1])
            if entry is not None and entry.get("type") == "file":
                found[url] = entry
    return found


def open_cached(url: str, info: dict | None = None, cache: FileCache | None = None):
    """A binary file of `url`: its local copy from the cache, or - an object larger than the
    whole cache - a stream from the store."""
    cache = cache or FileCache()
    fs, path = filesystem(url)
    info = info if info is not None else fs.info(path)
    if int(info.get("size") or 0) > cache.max_bytes:
        return fs.open(path, "rb")
    return open(cache.local_path(url, info), "rb")
