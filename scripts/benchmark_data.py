"""Images/s of lun.data's loader against a plain PIL pipeline on the same files, in the same run.

    python scripts/benchmark_data.py                       # 512 and 1024 px JPEG sources -> 512
    python scripts/benchmark_data.py --n 64 --workers 0 1  # quicker
    python scripts/benchmark_data.py --demo-steps 0        # skip the training-step measurement
    python scripts/benchmark_data.py --n 0 --demo-steps 0  # the epoch boundary only

The plain pipeline is what a data loader usually does: PIL open -> convert("RGB") -> resize the
short side to the target (bicubic) -> center crop -> numpy -> float tensor in [-1, 1]. Ours is
lun.data.local.Local: JPEG draft decoding (libjpeg scales by 1/2, 1/4, 1/8 in the DCT when the
source's short side is at least twice the target) and one resize that also crops. Both run in the
same DataLoader (batch 8) with 0 (in-process: one core), 1 and 2 workers; the best of `--repeats`
runs counts, since a shared machine only ever makes a run slower. The rate per worker (one
core each) says how many workers a GPU needs: `--gpu-rate` images/s (default 80, the SD 1.x UNet
step alone at 512 px on one H100, issue 30) over the per-worker rate, rounded up.

Then a few training steps of the demo model (configs/tiny/ldm.yaml on generated shapes) measure
the share of step time spent waiting for data. Prints markdown tables (for the README).

Last, the epoch boundary (`--boundary-epochs`, 0 skips it): a set whose items take a known time
(a sleep, so a loaded machine does not change it) trained through lun.data.DataModule with 2
persistent workers by a model whose step takes a known time; the wait before the first batch of
each later epoch against the median wait of the batches inside an epoch.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def make_sources(folder: Path, count: int, side: int, seed: int = 0) -> Path:
    """`count` photo-like JPEGs (smooth colour fields, edges, a little grain) of side x side."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        coarse = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
        field = np.asarray(
            Image.fromarray(coarse).resize((side, side), Image.Resampling.BICUBIC), dtype=np.int16
        )
        y, x = np.mgrid[0:side, 0:side]
        cx, cy, r = rng.integers(side // 4, 3 * side // 4, 3)
        field[(x - cx) ** 2 + (y - cy) ** 2 < (r // 2) ** 2] = rng.integers(0, 256, 3)
        field += rng.normal(0, 6, field.shape).astype(np.int16)
        image = Image.fromarray(field.clip(0, 255).astype(np.uint8))
        image.save(folder / "images" / f"{i:05d}.jpg", quality=90)
        (folder / "images" / f"{i:05d}.txt").write_text(f"sample {i}")
    return folder


class PlainPipeline:  # a map-style dataset: __len__ and __getitem__ are all DataLoader needs
    """The usual loader: open, convert, resize short side, center crop, to tensor."""

    def __init__(self, root: Path, size: int):
        self.paths = sorted((root / "images").glob("*.jpg"))
        self.size = size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict:
        import torch
        from PIL import Image

        path = self.paths[index]
        image = Image.open(path).convert("RGB")
        scale = self.size / min(image.size)
        image = image.resize(
            (round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC
        )
        left, top = (image.width - self.size) // 2, (image.height - self.size) // 2
        image = image.crop((left, top, left + self.size, top + self.size))
        pixels = (
            torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 127.5 - 1.0
        )  # (3, H, W)
        return {"image": pixels, "caption": path.with_suffix(".txt").read_text()}


def images_per_second(dataset, workers: int, batch_size: int = 8) -> float:
    """Throughput after the first batch (worker start-up is not the loader's speed)."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, shuffle=False)
    iterator = iter(loader)
    next(iterator)
    start, count = time.perf_counter(), 0
    for batch in iterator:
        count += len(batch["caption"])
    return count / (time.perf_counter() - start)


def loader_table(args, tmp: Path) -> list[str]:
    from lun.data.local import Local

    rows = [
        "| source | workers | plain PIL img/s | lun.data img/s | ratio | lun.data img/s per "
        f"worker | workers for {args.gpu_rate:g} img/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for side in args.sizes:
        root = make_sources(tmp / f"src{side}", args.n, side)
        plain = PlainPipeline(root, args.target)
        ours = Local(str(root), size=args.target, cache_dir=False)
        for workers in args.workers:
            best_plain = max(images_per_second(plain, workers) for _ in range(args.repeats))
            best_ours = max(images_per_second(ours, workers) for _ in range(args.repeats))
            label = f"{side}px JPEG -> {args.target}"
            ratio = best_ours / best_plain
            per_worker = best_ours / max(workers, 1)  # 0 workers: the main process is one
            needed = math.ceil(args.gpu_rate / per_worker)
            rows.append(
                f"| {label} | {workers} | {best_plain:.1f} | {best_ours:.1f} | {ratio:.2f}x "
                f"| {per_worker:.1f} | {needed} |"
            )
            print(rows[-1], flush=True)
    return rows


def demo_table(args, tmp: Path) -> list[str]:
    """Share of training-step time the demo model waits for its next batch."""
    import lightning as L
    from make_shapes import make_shapes
    from omegaconf import OmegaConf

    from ldm.util import instantiate_from_config

    class DataWait(L.Callback):
        def __init__(self):
            self.waits, self.steps, self._end = [], [], None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            now = time.perf_counter()
            if (
                self._end is not None
            ):  # the fetch happens between one batch's end and the next start
                self.waits.append(now - self._end)
            self._start = now

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._end = time.perf_counter()
            self.steps.append(self._end - self._start)

    config = OmegaConf.load(args.demo_config)
    make_shapes(tmp / "shapes", n=256, size=config.data.params.train.params.size, seed=0)
    rows = [
        "| demo model | workers | step (ms) | waiting for data (ms) | share of step time |",
        "|---|---|---|---|---|",
    ]
    for workers in args.demo_workers:
        data_config = OmegaConf.merge(
            config.data,
            {
                "params": {
                    "num_workers": workers,
                    "train": {"params": {"data_root": str(tmp / "shapes")}},
                }
            },
        )
        L.seed_everything(0)
        model = instantiate_from_config(config.model)
        timer = DataWait()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=args.demo_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer],
        )
        trainer.fit(model, datamodule=instantiate_from_config(data_config))
        wait, step = np.median(timer.waits[2:]), np.median(timer.steps[2:])  # after warm-up
        share = wait / (wait + step)
        name = Path(args.demo_config).name
        rows.append(f"| {name} | {workers} | {step * 1e3:.1f} | {wait * 1e3:.2f} | {share:.1%} |")
        print(rows[-1], flush=True)
    return rows


class TimedItems:  # a map-style dataset, importable by the loader's worker processes
    """`count` tiny items, each taking `item_s` seconds to load (a sleep: CPU-load independent)."""

    def __init__(self, count: int = 20, item_s: float = 0.01):
        self.count, self.item_s = count, item_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict:
        import torch

        time.sleep(self.item_s)
        return {"image": torch.zeros(3, 8, 8), "caption": str(index)}


def boundary_table(args) -> list[str]:
    """Wait before the first batch of an epoch vs a batch inside one (small set, 2 workers)."""
    import lightning as L
    import torch

    from lun.data import DataModule

    class TimedStep(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))
            self.waits: list[tuple[int, float]] = []  # (batch index in its epoch, wait)
            self._end = None

        def on_train_batch_start(self, batch, batch_idx):
            if self._end is not None:  # the fetch happens between one step's end and the next
                self.waits.append((batch_idx, time.perf_counter() - self._end))

        def training_step(self, batch, batch_idx):
            time.sleep(args.step_ms / 1e3)
            return (self.weight - batch["image"].mean()) ** 2

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self._end = time.perf_counter()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    batch, items = 4, 20
    item_s = args.step_ms / 1e3 / batch  # 2 workers load a batch in 2 steps: they keep up
    train = {"target": "benchmark_data.TimedItems", "params": {"count": items, "item_s": item_s}}
    model = TimedStep()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=args.boundary_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=DataModule(train, batch_size=batch, num_workers=2))
    first = [w for i, w in model.waits if i == 0]
    steady = float(np.median([w for i, w in model.waits if i > 1]))
    row = (
        f"| {items} items of {item_s * 1e3:.0f} ms, batch {batch}, 2 workers, step "
        f"{args.step_ms:g} ms | {1e3 * float(np.median(first)):.1f} | {1e3 * steady:.2f} |"
    )
    print(row, flush=True)
    return [
        "| epoch boundary | first batch of an epoch: wait (ms) | batch inside an epoch: wait (ms) |",
        "|---|---|---|",
        row,
    ]


def main() -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--n", type=int, default=96, help="source images per size")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[512, 1024], help="source sides (px)"
    )
    parser.add_argument("--target", type=int, default=512, help="training size (px)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gpu-rate", type=float, default=80.0, help="img/s a GPU step takes")
    parser.add_argument("--demo-config", default=str(ROOT / "configs" / "tiny" / "ldm.yaml"))
    parser.add_argument("--demo-steps", type=int, default=20, help="0 skips the demo measurement")
    parser.add_argument("--demo-workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument(
        "--boundary-epochs", type=int, default=4, help="epochs of the boundary test; 0 skips it"
    )
    parser.add_argument("--step-ms", type=float, default=40.0, help="its step time (ms)")
    args = parser.parse_args()
    import torch  # after parsing: --help answers at once

    torch.set_num_threads(1)  # one core per loader process, as in a real multi-worker run
    with tempfile.TemporaryDirectory() as tmp:
        tables = [loader_table(args, Path(tmp))] if args.n else []
        if args.demo_steps:
            torch.set_num_threads(2)
            tables.append(demo_table(args, Path(tmp)))
    if args.boundary_epochs:
        tables.append(boundary_table(args))
    print()
    for table in tables:
        print("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
