"""The bucket sampler's promise to DDP, for counts that do not divide: every rank gets the same
number of batches (a rank with one batch fewer leaves the others waiting in their last all-reduce
at the epoch's end), ceil(global / world) of them, and together they cover every global batch."""

import math

import pytest

from lun.data.buckets import BucketBatchSampler

# 7 + 5 + 3 items in batches of 2: 4 + 3 + 2 = 9 global batches - divides by neither 2 nor 4.
GROUPS = [0] * 7 + [1] * 5 + [2] * 3


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_rank_gets_the_same_count_and_all_batches_are_served(world_size, shuffle):
    global_batches = 4 + 3 + 2
    per_rank = []
    for rank in range(world_size):
        sampler = BucketBatchSampler(
            GROUPS, 2, shuffle=shuffle, seed=1, rank=rank, world_size=world_size
        )
        per_rank.append([tuple(batch) for batch in sampler])
        assert len(sampler) == len(per_rank[-1])  # what Lightning counts is what is served
    assert {len(batches) for batches in per_rank} == {math.ceil(global_batches / world_size)}
    served = {batch for batches in per_rank for batch in batches}
    every = BucketBatchSampler(GROUPS, 2, shuffle=shuffle, seed=1).global_batches(0)
    assert served == {tuple(batch.tolist()) for batch in every}


def test_the_ranks_top_up_from_the_start_of_the_epoch():
    """9 batches on 2 ranks: rank 1's fifth batch is global batch 0 again (the list wraps)."""
    ranks = [
        list(BucketBatchSampler(GROUPS, 2, shuffle=False, rank=r, world_size=2)) for r in (0, 1)
    ]
    every = BucketBatchSampler(GROUPS, 2, shuffle=False).global_batches(0)
    assert ranks[0] == [every[i].tolist() for i in (0, 2, 4, 6, 8)]
    assert ranks[1] == [every[i].tolist() for i in (1, 3, 5, 7, 0)]


def test_training_batches_are_full_and_one_bucket_each():
    sampler = BucketBatchSampler(GROUPS, 2, shuffle=True, seed=0, rank=1, world_size=4)
    for batch in sampler:
        assert len(batch) == 2 and len({GROUPS[i] for i in batch}) == 1
