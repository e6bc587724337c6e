"""Validation loss at fixed timesteps and fixed noise per item: a figure that moves only when the
model does.

The training loss draws t and noise afresh at every step, and the loss at t near 0 and near T
differs by orders of magnitude, so on a fixed set of images its value swings by more than a
model's progress. Here each validation item gets its timesteps and noise from a generator seeded
by the item's identity (its index in the validation set, `ITEM_KEY` in the batch) and nothing
else: not the batch, the epoch, the process, the device or the global random streams. The same
weights give the same figure with any batch size, on any number of devices, at any point of
training - and validating draws nothing from the streams training uses, so an exact resume stays
exact (lun.rng).

The timesteps are stratified: every item is evaluated once in each of `buckets` equal ranges of
[0, T), at a t drawn uniformly inside the range. Each bucket's figure then estimates the loss over
its range, and their mean - `val/loss` - the training objective E_t[loss] with far less variance
than one random t per item (stratified sampling; compare the low-discrepancy timesteps of Kingma
et al. 2021, "Variational Diffusion Models", arXiv:2107.00630, App. I.1).

The loss is the training objective (`LatentDiffusion.loss_at`, `ldm.objectives`: the eps, v or
flow MSE, min-SNR weights, the VLB term of learned-variance models, per-image weights), of the
clean latent: the VAE posterior's mean instead of a sample, and Gaussian noise without the
training-only offset noise.
"""

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

# The batch key holding each item's index in the validation set (lun.data.DataModule adds it).
ITEM_KEY = "item_index"
SEED = 0  # any fixed number: the draws are fixed by the item, this only names the set of them


def item_seed(key: int, seed: int = SEED) -> int:
    """A 64-bit seed of (seed, item key), well mixed (numpy's SeedSequence) so that the streams of
    neighbouring items are unrelated."""
    return int(np.random.SeedSequence([seed, int(key)]).generate_state(1, dtype=np.uint64)[0])


class FixedNoiseValidation:
    """Collects the per-item losses of one validation pass and reduces them over ranks.

    `step` evaluates a batch at every item's fixed timesteps and noise; `finish` gathers all
    ranks' items, counts each item once (a rank that repeats a batch to fill its share sees some
    twice) and returns {"val/loss": mean, "val/loss_t<lo>-<hi>": mean of each bucket}.
    """

    def __init__(self, num_timesteps: int, buckets: int = 4, seed: int = SEED):
        self.edges = [b * num_timesteps // buckets for b in range(buckets + 1)]
        self.names = [f"val/loss_t{lo}-{hi - 1}" for lo, hi in zip(self.edges, self.edges[1:])]
        self.seed = seed
        self.items, self.last = 0, {}  # items counted by the last `finish`, and its figures
        self._warned = False
        self.reset()

    def reset(self) -> None:
        self._keys: list[torch.Tensor] = []
        self._losses: list[torch.Tensor] = []

    def draws(self, key: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Item `key`'s timesteps (K,) - one uniform in each bucket - and noise (K, *shape), drawn
        on the CPU (the same numbers on every device type)."""
        generator = torch.Generator().manual_seed(item_seed(key, self.seed))
        lo, hi = torch.tensor(self.edges[:-1]), torch.tensor(self.edges[1:])
        u = torch.rand(len(lo), generator=generator, dtype=torch.float64)
        t = lo + (u * (hi - lo)).long()  # floor: lo <= t < hi
        noise = torch.randn((len(lo), *shape), generator=generator)
        return t, noise

    @torch.no_grad()
    def step(self, model, batch, batch_idx: int) -> torch.Tensor:
        """Per-item losses (B, K) of the batch at their fixed draws, kept for `finish`; returns
        the batch's mean."""
        z = clean_latent(model, batch)
        keys = self._item_keys(model, batch, batch_idx, len(z))
        cond = model.conditioning(batch)  # no caption dropout: drop=False
        draws = [self.draws(key, tuple(z.shape[1:])) for key in keys.tolist()]
        t = torch.stack([d[0] for d in draws]).to(z.device)  # (B, K)
        noise = torch.stack([d[1] for d in draws]).to(z.device, z.dtype)  # (B, K, C, h, w)
        losses = torch.stack(
            [model.loss_at(z, cond, t[:, k], noise[:, k], batch) for k in range(t.shape[1])], 1
        )  # (B, K)
        self._keys.append(keys)
        self._losses.append(losses.double().cpu())
        return losses.mean()

    def _item_keys(self, model, batch, batch_idx: int, size: int) -> torch.Tensor:
        if ITEM_KEY in batch:
            return torch.as_tensor(batch[ITEM_KEY]).long().cpu()
        # A dataset that does not say which item is which (a stream, a custom collate): key by
        # the place in this rank's batches - fixed for a fixed batch size and device count only.
        if not self._warned:
            log.warning(
                "validation batches carry no %r: the fixed noise is keyed by batch position, so "
                "val/loss changes with the batch size and the number of devices",
                ITEM_KEY,
            )
            self._warned = True
        trainer = model._trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        return (batch_idx * world + rank) * (1 << 20) + torch.arange(size)

    def finish(self, model) -> dict[str, float]:
        """The figures of all items of this pass over all ranks (the same on every rank)."""
        keys = torch.cat(self._keys) if self._keys else torch.zeros(0, dtype=torch.long)
        losses = torch.cat(self._losses) if self._losses else torch.zeros(0, len(self.names))
        keys, losses = gather_rows(model, keys, losses.double())
        self.reset()
        if not len(keys):
            return {}
        # Each item once, in key order: the sum runs the same way whatever the ranks and batches.
        unique, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        sums = torch.zeros(len(unique), losses.shape[1], dtype=torch.float64)
        sums.index_add_(0, inverse, losses)
        counts = torch.zeros(len(unique), dtype=torch.float64).index_add_(
            0, inverse, torch.ones(len(keys), dtype=torch.float64)
        )
        per_bucket = (sums / counts[:, None]).mean(0)  # (K,)
        self.items = len(unique)
        # Every item has one t per bucket: the overall mean is the mean of the bucket means.
        figures = {"val/loss": float(per_bucket.mean())}
        figures.update({name: float(v) for name, v in zip(self.names, per_bucket)})
        self.last = dict(figures)
        return figures


def clean_latent(model, batch) -> torch.Tensor:
    """The model's latent of the batch without posterior noise: the VAE posterior's mean (or a
    cached latent's mean; a latent cached already sampled is used as it is), shifted and scaled
    (`LatentDiffusion.scale_latents`; the batch contract's `batch_latents`)."""
    return model.batch_latents(batch, mean=True)


def gather_rows(model, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Concatenate each rank's rows of `tensors` (lengths may differ between ranks), in rank
    order, on the CPU. One process: the tensors as they are."""
    trainer = model._trainer
    if trainer is None or trainer.world_size == 1:
        return list(tensors)
    count = torch.tensor([len(tensors[0])], device=model.device)
    counts = model.all_gather(count).view(-1).tolist()  # (world,)
    most = max(counts)
    gathered = []
    for x in tensors:
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[: len(x)] = x
        rows = model.all_gather(padded.to(model.device)).cpu()  # (world, most, ...)
        gathered.append(torch.cat([rows[r, :n] for r, n in enumerate(counts)]))
    return gathered
