"""Aspect-ratio buckets and the batch sampler's invariants on one and two simulated ranks."""

import numpy as np
import pytest

from lun.data.buckets import (
    BucketBatchSampler,
    BucketSpec,
    assign_buckets,
    make_buckets,
    resume_point,
)


def test_buckets_respect_area_step_and_max_aspect():
    spec = BucketSpec.from_config({"step": 64, "max_aspect": 2.0}, size=512)
    buckets = make_buckets(spec)
    assert (512, 512) in buckets
    assert (384, 640) in buckets and (640, 384) in buckets
    for width, height in buckets:
        assert width % 64 == 0 and height % 64 == 0
        assert width * height <= 512 * 512
        assert max(width / height, height / width) <= 2.0
    ratios = [w / h for w, h in buckets]
    assert ratios == sorted(ratios)
    assert BucketSpec.from_config(True, size=256) == BucketSpec(
        area=256 * 256, step=64, max_aspect=2.0
    )


def test_bucket_spec_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown key"):
        BucketSpec.from_config({"steps": 64}, size=512)
    with pytest.raises(ValueError, match="max_aspect"):
        BucketSpec.from_config({"max_aspect": 0.5}, size=512)


def test_each_image_goes_to_the_nearest_aspect():
    buckets = [(384, 640), (512, 512), (640, 384)]
    assert assign_buckets([0.5, 0.62, 0.95, 1.1, 1.6, 3.0], buckets).tolist() == [0, 0, 1, 1, 2, 2]
    # Measured in log ratio: 2:1 and 1:2 are as far from 1:1.
    assert assign_buckets([2.0, 0.5], [(1, 1), (4, 1), (1, 4)]).tolist() == [0, 0]


def _epoch(sampler, epoch):
    sampler.set_epoch(epoch)
    return list(sampler)


def test_sampler_invariants_on_two_ranks():
    groups = np.array([0] * 7 + [1] * 5 + [2] * 2)  # 14 items in 3 buckets
    ranks = [BucketBatchSampler(groups, 3, seed=5, rank=r, world_size=2) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 3  # ceil((3 + 2 + 1) / 2)
    for epoch in range(3):
        per_rank = [_epoch(sampler, epoch) for sampler in ranks]
        assert [len(batches) for batches in per_rank] == [3, 3]  # same count: no hang at epoch end
        batches = [b for rank_batches in per_rank for b in rank_batches]
        assert all(len(b) == 3 for b in batches)  # training batches are always full
        assert all(len(set(groups[b])) == 1 for b in batches)  # one bucket per batch
        assert set(np.concatenate(batches)) == set(range(14))  # every item seen each epoch
    # Deterministic per (seed, epoch), different across epochs and seeds.
    again = BucketBatchSampler(groups, 3, seed=5, rank=0, world_size=2)
    assert _epoch(again, 1) == _epoch(ranks[0], 1)
    assert _epoch(ranks[0], 1) != _epoch(ranks[0], 2)
    assert _epoch(BucketBatchSampler(groups, 3, seed=6, rank=0, world_size=2), 1) != _epoch(
        ranks[0], 1
    )


def test_ranks_split_the_epoch_without_overlap_when_it_divides():
    groups = np.zeros(16, dtype=int)
    ranks = [BucketBatchSampler(groups, 2, seed=0, rank=r, world_size=2) for r in range(2)]
    items = [np.concatenate(list(s)) for s in ranks]
    assert not set(items[0]) & set(items[1])
    assert sorted(np.concatenate(items)) == list(range(16))


def test_validation_order_is_fixed_and_complete():
    groups = np.array([0, 1, 0, 1, 0])
    sampler = BucketBatchSampler(groups, 2, shuffle=False)
    assert _epoch(sampler, 0) == _epoch(sampler, 3) == [[0, 2], [4], [1, 3]]


def test_begin_epoch_serves_epoch_zero_then_counts_up():
    sampler = BucketBatchSampler(np.zeros(8, dtype=int), 2, seed=1)
    orders = []
    for _ in range(3):
        sampler.begin_epoch()
        orders.append(list(sampler))
    assert orders == [
        _epoch(BucketBatchSampler(np.zeros(8, dtype=int), 2, seed=1), e) for e in range(3)
    ]


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_mid_epoch_continues_with_the_next_batch(world_size):
    groups = np.array([0] * 9 + [1] * 9)

    def make(rank):
        return BucketBatchSampler(groups, 2, seed=3, rank=rank, world_size=world_size)

    for rank in range(world_size):
        full = make(rank)
        full.set_epoch(2)
        iterator = iter(full)
        taken = [next(iterator) for _ in range(2)]
        state = full.state_dict()
        assert state["epoch"] == 2 and state["position"] == 2
        resumed = make(rank)
        resumed.load_state_dict(state)
        resumed.begin_epoch()
        assert taken + list(resumed) == _epoch(make(rank), 2)
        resumed.begin_epoch()  # the following epoch is whole again
        assert list(resumed) == _epoch(make(rank), 3)


def test_resume_on_another_number_of_devices_keeps_the_global_position():
    groups = np.zeros(24, dtype=int)
    two = [BucketBatchSampler(groups, 2, seed=0, rank=r, world_size=2) for r in range(2)]
    consumed = [b for s in two for b in list(s)[:2]]  # each of 2 ranks took 2 batches
    one = BucketBatchSampler(groups, 2, seed=0)
    one.load_state_dict({**two[0].state_dict(), "position": 2})
    one.begin_epoch()
    rest = list(one)
    assert len(rest) == len(one) - 4
    assert sorted(np.concatenate(consumed + rest)) == list(range(24))


def test_complete_epoch_resumes_at_the_next_one():
    assert resume_point({"epoch": 4, "position": 5, "world_size": 1, "num_batches": 5}, 5, 1) == (
        5,
        0,
    )
    assert resume_point({"epoch": 4, "position": 3, "world_size": 1, "num_batches": 5}, 5, 1) == (
        4,
        3,
    )
