"""Finding a folder dataset's files fast, and remembering what was found.

One `os.scandir` walk lists every file with its size and mtime; no image is opened unless aspect
ratios are needed (buckets, `aspect_range`, `verify_images`). The finished index is cached as JSON
under a hash of that listing (plus the options that shape it), so the next start on an unchanged
folder costs one walk and one JSON read, and any added, removed or rewritten file rebuilds it.
"""

import hashlib
import json
import logging
import os
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lun.data.images import IMAGE_EXTENSIONS, ImageError, image_size

logger = logging.getLogger("lun.data")

# 2: metadata paths outside data_root are refused; the index lists files kept with a note.
# 3: the index counts the metadata files that consider_every_nth passed over.
# 4: files under metadata/ that are not .json are counted (skipped), not passed over; a caption
#    file's extension matches in any case (a.TXT).
CACHE_VERSION = 4
# Header reads are mostly I/O waits (network file systems especially); threads overlap them.
HEADER_THREADS = 16


class StringArray:
    """An immutable list of strings in one bytes buffer plus offsets.

    A Python list of a million strings is a million refcounted objects; DataLoader workers forked
    from the main process touch those refcounts and slowly copy the whole list into each worker.
    Two numpy arrays have no such objects, so the memory stays shared.
    """

    def __init__(self, strings):
        encoded = [s.encode("utf-8") for s in strings]
        self._offsets = np.cumsum([0] + [len(b) for b in encoded], dtype=np.int64)
        self._buffer = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> str:
        start, end = self._offsets[index], self._offsets[index + 1]
        return self._buffer[start:end].tobytes().decode("utf-8")


def walk(root: str, unusable: list | None = None) -> list[tuple[str, int, int]]:
    """(path relative to root with "/" separators, size, mtime_ns) of each file, sorted.

    Hidden files and folders (".DS_Store", macOS "._name.jpg" resource forks, caches) are left
    out; symlinked folders are followed once (a link loop is not walked twice). Files that look
    present but cannot be used are appended to `unusable` as (path, reason, detail), for the
    caller to count (without it, logged): a symlink whose target is gone, and a name that is not
    UTF-8 (a zip from an old Windows tool) - the index, its cache and the logs are UTF-8.
    """
    listing, stack, seen = [], [(root, "")], set()
    found_unusable = [] if unusable is None else unusable
    while stack:
        folder, prefix = stack.pop()  # prefix: the folder relative to root, "" or ending in "/"
        real = os.path.realpath(folder)
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = list(os.scandir(folder))
        except OSError as err:
            logger.warning("cannot list %s: %s", folder, err)
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            rel = prefix + entry.name
            try:
                if entry.is_dir():  # (its files are named one by one when it is not UTF-8)
                    stack.append((entry.path, f"{rel}/"))
                elif not rel.isascii() and not _is_utf8(rel):
                    shown = os.fsencode(rel).decode("utf-8", "backslashreplace")
                    found_unusable.append((shown, "file name not UTF-8", RENAME_HINT))
                elif entry.is_file():
                    stat = entry.stat()
                    listing.append((rel, stat.st_size, stat.st_mtime_ns))
                elif entry.is_symlink():
                    found_unusable.append((rel, "broken link", f"-> {os.readlink(entry.path)}"))
            except OSError as err:  # a file removed while walking
                logger.debug("cannot stat %s: %s", entry.path, err)
    if unusable is None:
        for rel, reason, detail in found_unusable:
            logger.warning("skipped %s: %s (%s)", os.path.join(root, rel), reason, detail)
    listing.sort()
    return listing


# How to fix a name that is not UTF-8 (convmv ships with most Linux distributions).
RENAME_HINT = "rename it to UTF-8, e.g. convmv -r -f cp1252 -t utf-8 --notest DIR"


def _is_utf8(name: str) -> bool:
    """False for a name os.scandir decoded with surrogate escapes (bytes that are not UTF-8)."""
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def describe_listing(listing) -> str:
    """What a folder holds, by extension, for the "no usable items" error."""
    counts = Counter(os.path.splitext(rel)[1].lower() or "(no extension)" for rel, _, _ in listing)
    if not counts:
        return "no files at all"
    return ", ".join(f"{n} {ext}" for ext, n in counts.most_common(8))


def default_cache_dir() -> str:
    """$LUN_CACHE_DIR, else $XDG_CACHE_HOME/lun/index, else ~/.cache/lun/index."""
    if os.environ.get("LUN_CACHE_DIR"):
        return os.environ["LUN_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lun", "index")


def _absolute(root: str) -> str:
    return root if "://" in root else os.path.abspath(root)  # a URL (lun.storage) as it is


def cache_key(root: str, listing, options: dict) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([CACHE_VERSION, _absolute(root), options], sort_keys=True).encode())
    for rel, size, mtime in listing:
        digest.update(f"{rel}\0{size}\0{mtime}\n".encode())
    return digest.hexdigest()[:32]


def load_cached(cache_dir: str | None, key: str) -> dict | None:
    if not cache_dir:
        return None
    path = os.path.join(cache_dir, f"{key}.json")
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # a half-written or foreign file: rebuild
        logger.info("ignoring index cache %s: %s", path, err)
        return None


def save_cached(cache_dir: str | None, key: str, index: dict) -> None:
    """Write atomically (temp file + rename); a read-only cache folder only costs speed."""
    if not cache_dir:
        return
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(index, file, ensure_ascii=False)
        os.replace(tmp, os.path.join(cache_dir, f"{key}.json"))
    except OSError as err:
        logger.info(
            "cannot write the index cache in %s (%s); indexing again next time", cache_dir, err
        )


def is_image(rel: str) -> bool:
    return rel.lower().endswith(IMAGE_EXTENSIONS)


def flat_records(listing) -> tuple[dict, list]:
    """Images under `images/` (or the root when there is no such folder) with their captions.

    The caption of `images/a/b.png` is `captions/a/b.txt`, else `images/a/b.txt` beside it.
    Returns columns {"image", "caption" (None when missing)} and [(path, reason, detail)] skipped.
    """
    sizes = {rel: size for rel, size, _ in listing}
    # Caption files by their name with a lower-case ".txt": "a.TXT" (Windows) is a's caption too.
    texts = {rel[:-4] + ".txt": rel for rel in sizes if rel[-4:].lower() == ".txt"}
    prefix = "images/" if any(rel.startswith("images/") for rel in sizes) else ""
    records, skipped = {"image": [], "caption": []}, []
    for rel, size in sizes.items():
        if not rel.startswith(prefix) or not is_image(rel):
            continue
        if not prefix and rel.startswith(("captions/", "metadata/")):
            continue
        if size == 0:
            skipped.append((rel, "zero bytes", ""))
            continue
        stem = os.path.splitext(rel)[0]
        candidates = (f"captions/{stem[len(prefix) :]}.txt", f"{stem}.txt")
        records["image"].append(rel)
        records["caption"].append(next((texts[c] for c in candidates if c in texts), None))
    return records, skipped


# Caption tables of other layouts (Hugging Face imagefolder's metadata.jsonl / .csv, a LAION
# export's .parquet) that flat-file mode does not read: named when no image has a .txt caption.
CAPTION_TABLES = (".jsonl", ".csv", ".tsv", ".parquet")


def captions_elsewhere(listing) -> tuple[str, str] | None:
    """Where a folder whose images have no .txt caption keeps its captions, if we can tell, and
    what to do: metadata/**/*.json (metadata mode's layout), `.caption` files (kohya-ss's
    fine-tuning default), or a caption table at the top (or in images/)."""
    for rel, _, _ in listing:
        if rel.startswith("metadata/") and rel.lower().endswith(".json"):
            return rel, "set metadata_params (metadata_params: {} for the defaults) to read them"
    for rel, _, _ in listing:
        if rel.lower().endswith(".caption"):
            return rel, (
                "captions are read from <name>.txt: rename the .caption files "
                '(for f in $(find DIR -name \'*.caption\'); do mv "$f" "${f%.caption}.txt"; done)'
            )
    for rel, _, _ in listing:
        top = rel[len("images/") :] if rel.startswith("images/") else rel
        if "/" not in top and top.lower().endswith(CAPTION_TABLES):
            return rel, (
                "flat files read images/<name>.txt (or <name>.txt beside the image): "
                "write each caption there"
            )
    return None


def read_aspects(path_of, records: dict, max_pixels: int) -> list:
    """Fill records["aspect"] (width / height, EXIF-upright) from image headers where missing;
    `path_of` gives the local file of a path relative to data_root (lun.data.local.Local.path).

    Images whose header cannot be read are dropped from `records`; returns their
    [(path, reason, detail)].
    """
    aspects = records.setdefault("aspect", [None] * len(records["image"]))
    todo = [i for i, a in enumerate(aspects) if a is None]

    def read(i):
        try:
            width, height = image_size(path_of(records["image"][i]), max_pixels)
            return width / height
        except ImageError as err:
            return err

    with ThreadPoolExecutor(HEADER_THREADS) as pool:
        for i, result in zip(todo, pool.map(read, todo)):
            aspects[i] = result
    bad = [i for i in todo if isinstance(aspects[i], ImageError)]
    skipped = [(records["image"][i], aspects[i].reason, aspects[i].detail) for i in bad]
    keep_rows(records, [i for i in range(len(aspects)) if not isinstance(aspects[i], ImageError)])
    return skipped


def keep_rows(records: dict, rows) -> None:
    """Keep only `rows` (indices, in order) of every column, in place."""
    for column, values in records.items():
        records[column] = [values[i] for i in rows]
