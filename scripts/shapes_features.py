"""Train a small classifier on the shapes data and save it as a FID / KID feature extractor.

    python scripts/shapes_features.py --out shapes-features.safetensors --size 16

FID is defined on ImageNet Inception-v3 features, whose weights cannot be downloaded on every
machine (nor are they made for 16 x 16 synthetic shapes). For the shapes demo a small CNN
(lun.eval.features.SmallCNN) learns the 18 colour-shape classes of scripts/make_shapes.py on
freshly drawn images; its pooled last-block features then serve as the FID feature space - the
same Frechet distance on a feature space that knows what matters in this data. The file is a
.safetensors whose header says how to rebuild the network (`load_features` reads it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lun.eval.features import SmallCNN


import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_shapes import class_names, make_shapes  # noqa: E402


def shapes_tensors(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n images (n, 3, size, size) in [-1, 1] and their class ids (colour-shape)."""
    import torch

    from lun.data.images import load_image_tensor

    names = class_names()
    with tempfile.TemporaryDirectory() as folder:
        records = make_shapes(Path(folder), n, size, seed)
        images = torch.stack(
            [
                load_image_tensor(str(Path(folder) / "images" / f"{r.name}.png"), (size, size))
                for r in records
            ]
        )
    labels = torch.tensor([names.index(f"{r.color}-{r.shape}") for r in records])
    return images, labels


def train(args) -> tuple[SmallCNN, float]:
    import torch
    import torch.nn.functional as F

    from lun.eval.features import SmallCNN

    torch.manual_seed(args.seed)
    images, labels = shapes_tensors(args.n, args.size, args.seed + 1000)  # not the demo's data
    test_images, test_labels = shapes_tensors(args.n // 5, args.size, args.seed + 2000)
    net = SmallCNN(num_classes=len(class_names()), widths=tuple(args.widths), size=args.size)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * (len(images) // args.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=steps)
    for epoch in range(args.epochs):
        order = torch.randperm(len(images))
        for start in range(0, len(images) - args.batch_size + 1, args.batch_size):
            batch = order[start : start + args.batch_size]
            x = images[batch]
            x = torch.where(torch.rand(len(x), 1, 1, 1) < 0.5, x, x.flip(-1))  # mirror: same class
            loss = F.cross_entropy(net.logits(x), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
        print(f"epoch {epoch + 1}: loss {loss.item():.3f}")
    net.eval()
    with torch.no_grad():
        predicted = torch.cat([net.logits(x).argmax(1) for x in test_images.split(256)])
    return net, float((predicted == test_labels).float().mean())


def main(argv=None) -> None:
    from lun.cli import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--out", required=True, help="the .safetensors file to write")
    parser.add_argument("--size", type=int, default=16, help="image side (the demo's: 16)")
    parser.add_argument("--n", type=int, default=3000, help="training images (drawn fresh)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from safetensors.torch import save_file  # after parsing: --help answers at once

    started = time.perf_counter()
    net, accuracy = train(args)
    metadata = {**net.metadata(), "test_accuracy": f"{accuracy:.4f}"}
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, args.out, metadata)
    print(
        f"wrote {args.out}: held-out accuracy {100 * accuracy:.1f} % on 18 colour-shape classes, "
        f"{net.dim}-d features ({time.perf_counter() - started:.0f} s)"
    )


if __name__ == "__main__":
    main()
