"""Bad dataset values the newer configs use (aspect buckets, the decompression-bomb limit) and
an image size the model cannot take: one ValueError / problem line naming the key, found when
the launcher builds, instead of a TypeError or the first step failing (a traceback)."""

from types import SimpleNamespace

import pytest

from lun.data.buckets import BucketSpec
from lun.data.class_folder import ClassFolder
from lun.data.local import Local
from lun.trainer import image_size_problem

BAD_BUCKETS = [
    ("abc", "buckets: expected true or a mapping of area, step, max_aspect, got 'abc'"),
    (5, "buckets: expected true or a mapping of area, step, max_aspect, got 5"),
    ({"step": "abc"}, "buckets.step='abc': expected a whole number of pixels"),
    ({"step": 32.5}, "buckets.step=32.5: expected a whole number of pixels"),
    ({"max_aspect": "abc"}, "buckets.max_aspect='abc': expected a number"),
    ({"area": "abc"}, "buckets.area='abc': expected a number of pixels"),
    ({"aera": 1024}, "buckets: unknown key"),
]


@pytest.mark.parametrize(("config", "message"), BAD_BUCKETS, ids=[str(c) for c, _ in BAD_BUCKETS])
def test_bad_buckets_are_a_value_error_naming_the_key(config, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        BucketSpec.from_config(config, 32)


def test_bucket_settings_users_write_still_work():
    assert BucketSpec.from_config({"area": 1e6, "step": 64}, 32).area == 1_000_000  # 1e6: a float
    assert BucketSpec.from_config({"step": 16, "max_aspect": 2}, 32) == BucketSpec(1024, 16, 2)
    assert BucketSpec.from_config({"area": None, "step": 16}, 32).area == 1024  # the default


@pytest.mark.parametrize("dataset", [Local, ClassFolder])
@pytest.mark.parametrize("value", ["abc", 0, -1, 2.5, True])
def test_a_bad_max_image_pixels_is_named(tmp_path, dataset, value):
    with pytest.raises(ValueError, match=rf"^max_image_pixels={value!r}: expected a whole number"):
        dataset(data_root=str(tmp_path), max_image_pixels=value)


class _Model:
    """latent_shape as LatentDiffusion's: sides must be multiples of `size_multiple`."""

    def __init__(self, size_multiple: int):
        self.size_multiple = size_multiple

    def latent_shape(self, height, width):
        if height % self.size_multiple or width % self.size_multiple:
            raise ValueError(f"height and width must be multiples of {self.size_multiple}")
        return 4, height // 8, width // 8


def _data(**datasets):
    return SimpleNamespace(datasets=datasets)


def test_an_image_size_the_model_cannot_take_names_the_split_and_key():
    square = SimpleNamespace(size=30, bucket_sizes=[(30, 30)])
    problem = image_size_problem(
        _Model(16), _data(train=SimpleNamespace(size=32), validation=square)
    )
    assert problem == (
        "data.params.validation.params.size=30: height and width must be multiples of 16"
    )
    buckets = SimpleNamespace(size=32, bucket_sizes=[(32, 32), (48, 24)])
    problem = image_size_problem(_Model(16), _data(train=buckets))
    assert problem.startswith("data.params.train.params.buckets: the bucket 48x24: height and")
    assert problem.endswith("multiples of 16; change buckets.step")


def test_image_sizes_that_fit_and_data_without_sizes_pass():
    fits = SimpleNamespace(size=32, bucket_sizes=[(32, 32), (48, 16)])
    assert image_size_problem(_Model(16), _data(train=fits, test=SimpleNamespace())) is None
    assert image_size_problem(_Model(16), SimpleNamespace()) is None  # not a lun DataModule
