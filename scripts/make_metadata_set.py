"""Make a metadata-mode dataset whose items meet each filter rule a chosen number of times.

    python scripts/make_metadata_set.py --out data/meta100k --items 100000
    python scripts/make_metadata_set.py --out data/meta10k --items 10000 --image-size 64 --unique

Writes `metadata/NNNNNN.json` ({"tags", "score", "path", "width", "height"}, the layout of
lun.data.metadata) and a few small PNGs they point to (or one per item with `--unique`, for
timing `--decode`). Each considered file gets one *fate* - the rule it is written to meet - in
shuffled order; files between every `every_nth`-th are plain kept items that
`consider_every_nth` passes over. The fates, for the params in `PARAMS` below:

    ok            score 50, common tags, square             kept
    empty         no tags                                    kept, empty caption
    long          80 distinct tags                           kept, over 77 CLIP tokens
    rescued       score 10 + tag "good" (+15)                kept (25 >= min_score 20)
    wide          2:1 aspect                                 kept, in a wide bucket
    abs_min       score 1 and a blacklisted tag              below abs_min_score (checked first)
    black_a/_b    score 50 and tag "bad_a" / "bad_b"         blacklisted tag 'bad_a' / 'bad_b'
    min_score     score 10                                   below min_score after bonuses
    sunk          score 50 + tag "meh" (-40)                 below min_score after bonuses
    aspect        3:1                                        outside aspect_range
    outside       path "../x.png" or "/etc/x.png"            path outside data_root
    missing       path to no file                            image not found
    zero_byte     path to a zero-byte image                  zero-byte image
    malformed     not JSON                                   malformed JSON
    no_score      no "score"                                 missing field
"""

import argparse
import json
import random
from pathlib import Path

from PIL import Image

PARAMS = {
    "consider_every_nth": 2,
    "abs_min_score": 5,
    "min_score": 20,
    "blacklist_tags": ["bad_a", "bad_b"],
    "tag_bonus_scores": {"good": 15, "meh": -40},
    "aspect_range": [0.4, 2.5],
}
FATES = (
    "ok",
    "empty",
    "long",
    "rescued",
    "wide",
    "abs_min",
    "black_a",
    "black_b",
    "min_score",
    "sunk",
    "aspect",
    "outside",
    "missing",
    "zero_byte",
    "malformed",
    "no_score",
)
COMMON = [["1girl", "solo", "smile"], ["cat", "outdoors"], ["landscape", "sky", "tree", "river"]]


def _item(fate: str, image: str, rng: random.Random, j: int) -> dict | str:
    tags = list(COMMON[j % len(COMMON)])
    meta = {"tags": tags, "score": 50, "path": image, "width": 512, "height": 512}
    if fate == "empty":
        meta["tags"] = []
    elif fate == "long":
        meta["tags"] = [f"word{j}x{k}" for k in range(80)]
    elif fate == "rescued":
        meta.update(score=10, tags=tags + ["good"])
    elif fate == "wide":
        meta.update(width=1024, height=512)
    elif fate == "abs_min":
        meta.update(score=1, tags=tags + ["bad_a"])
    elif fate in ("black_a", "black_b"):
        meta["tags"] = tags + ["bad_" + fate[-1]]
    elif fate == "min_score":
        meta["score"] = 10
    elif fate == "sunk":
        meta["tags"] = tags + ["meh"]
    elif fate == "aspect":
        meta.update(width=1536, height=512)
    elif fate == "outside":
        meta["path"] = "../x.png" if j % 2 else "/etc/x.png"
    elif fate == "missing":
        meta["path"] = f"images/none_{j}.png"
    elif fate == "zero_byte":
        meta["path"] = "images/empty.png"
    elif fate == "malformed":
        return '{"tags": ["a", '
    elif fate == "no_score":
        del meta["score"]
    return meta


def make_metadata_set(
    out, fates: dict, every_nth: int = 2, seed: int = 0, image_size: int = 8, unique=False
) -> None:
    """Write the set: `fates` {fate: count} among the considered files (every `every_nth`-th in
    sorted order), plain kept items between them."""
    out = Path(out)
    (out / "metadata").mkdir(parents=True, exist_ok=True)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    order = [fate for fate, count in fates.items() for _ in range(count)]
    rng.shuffle(order)
    total = len(order) * every_nth
    shared = 16
    for k in range(total if unique else shared):
        color = (k * 37 % 256, k * 91 % 256, k * 53 % 256)
        image = Image.new("RGB", (image_size, image_size), color)
        image.putpixel((k % image_size, k // image_size % image_size), (255 - color[0], 0, 0))
        image.save(out / "images" / f"{k:06d}.png")
    (out / "images" / "empty.png").write_bytes(b"")
    for i in range(total):
        fate = order[i // every_nth] if i % every_nth == 0 else "ok"
        image = f"images/{(i if unique else i % shared):06d}.png"
        meta = _item(fate, image, rng, i)
        text = meta if isinstance(meta, str) else json.dumps(meta)
        (out / "metadata" / f"{i:06d}.json").write_text(text, encoding="utf-8")


def main() -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--items", type=int, default=100_000, help="metadata files in all")
    parser.add_argument("--image-size", type=int, default=8)
    parser.add_argument("--unique", action="store_true", help="one image file per item")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # One line and exit status 2 (argparse's), before anything is written.
    for flag, value in (("--items", args.items), ("--image-size", args.image_size)):
        if value < 1:
            parser.error(f"{flag}={value}: expected a whole number >= 1")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out}: is a file; give the folder to write the set in")
    every_nth = PARAMS["consider_every_nth"]
    per_fate = args.items // every_nth // len(FATES)
    fates = dict.fromkeys(FATES, per_fate)
    fates["ok"] += args.items // every_nth - per_fate * len(FATES)
    make_metadata_set(args.out, fates, every_nth, args.seed, args.image_size, args.unique)
    print(f"wrote {args.items} metadata files to {args.out}; metadata_params: {json.dumps(PARAMS)}")


if __name__ == "__main__":
    main()
