"""Each sample says where it came from (SDXL's micro-conditioning): original size, crop, target."""

import numpy as np
import pytest
from PIL import Image

from lun.data.local import Local


@pytest.fixture
def wide_image(tmp_path):
    """A 40 x 20 image whose red channel is the column index x 6: the crop's left edge shows."""
    pixels = np.zeros((20, 40, 3), dtype=np.uint8)
    pixels[..., 0] = np.arange(40)[None, :] * 6
    Image.fromarray(pixels).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("a gradient")
    return tmp_path


def left_column(image) -> float:
    """The column of the resized (32 x 16) image that the sample's leftmost pixels show."""
    red = (image[0, :, 0].mean().item() + 1) * 255 / 2  # [-1, 1] -> 0..255
    return red / 6 * 0.8  # source column -> resized column (scale 16 / 20)


@pytest.mark.parametrize("flip_p", [0.0, 1.0])
def test_random_crops_report_their_offsets_in_the_resized_image(wide_image, flip_p):
    dataset = Local(str(wide_image), size=16, crop="random", flip_p=flip_p, cache_dir=False)
    lefts = set()
    for _ in range(12):
        item = dataset[0]
        assert item["original_size_as_tuple"].tolist() == [20, 40]  # (height, width)
        assert item["target_size_as_tuple"].tolist() == [16, 16]
        top, left = item["crop_coords_top_left"].tolist()
        assert top == 0 and 0 <= left <= 16  # the image resized to cover 16 x 16 is 32 x 16
        # the resized image's column the sample starts with: the crop's left edge, or when
        # flipped its right edge (the crop's left edge in the mirrored image is 32 - 16 - that)
        expected = left if not flip_p else 31 - left
        assert abs(left_column(item["image"]) - expected) < 1.5
        lefts.add(left)
    assert len(lefts) > 3  # random crops, not one


def test_bucketed_samples_report_their_bucket_as_target_size(wide_image):
    dataset = Local(str(wide_image), size=32, buckets={"step": 8}, cache_dir=False)
    item = dataset[0]
    height, width = item["image"].shape[-2:]
    assert width > height  # a wide bucket
    assert item["target_size_as_tuple"].tolist() == [height, width]
    assert item["original_size_as_tuple"].tolist() == [20, 40]
