"""FID / KID against torchmetrics on the same features; the feature extractors and CLIP score."""

import numpy as np
import pytest
import torch
from eval_helpers import make_clip_folder
from safetensors.torch import save_file

from lun.callbacks.evaluation import read_prompt_file
from lun.eval.features import InceptionV3, SmallCNN, load_features
from lun.eval.fid import fid, fit_gaussian, frechet_distance, kid


class Given(torch.nn.Module):
    """torchmetrics' custom `feature` module: the 'images' handed to update() are the features."""

    def __init__(self, dim: int):
        super().__init__()
        self.num_features = dim

    def forward(self, x):
        return x


def features(n: int, dim: int, seed: int, shift: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(dim, dim)) / dim**0.5  # correlated, unequal variances
    return rng.normal(size=(n, dim)) @ mixing + shift + 3.0


def test_fid_of_identical_sets_is_zero():
    x = features(64, 8, 0)
    assert abs(fid(x, x)) < 1e-8
    assert fid(x, features(64, 8, 1, shift=0.5)) > 1.0


def test_fid_matches_torchmetrics():
    from torchmetrics.image.fid import FrechetInceptionDistance

    # Unequal covariances, so the Tr((S1 S2)^1/2) term matters (a wrong factor on it fails).
    real, fake = features(80, 6, 0), 1.7 * features(60, 6, 1, shift=0.3)
    metric = FrechetInceptionDistance(feature=Given(6))
    metric.update(torch.from_numpy(real), real=True)
    metric.update(torch.from_numpy(fake), real=False)
    expected = metric.compute().item()
    assert fid(real, fake) == pytest.approx(expected, rel=1e-9, abs=1e-9)
    # The same from the Gaussians as the reference cache stores them.
    assert frechet_distance(fit_gaussian(real), fit_gaussian(fake)) == pytest.approx(expected)


def test_kid_matches_torchmetrics():
    from torchmetrics.image.kid import KernelInceptionDistance

    real, fake = features(40, 5, 2), features(30, 5, 3, shift=0.4)
    metric = KernelInceptionDistance(feature=Given(5), subsets=7, subset_size=20)
    metric.update(torch.from_numpy(real), real=True)
    metric.update(torch.from_numpy(fake), real=False)
    torch.manual_seed(11)  # torchmetrics draws its subsets from the global generator
    mean, std = metric.compute()
    ours = kid(real, fake, subsets=7, subset_size=20, seed=11)
    assert ours == pytest.approx((mean.item(), std.item()), rel=1e-9)
    assert ours[1] > 0
    # Unbiased: two draws of one distribution score ~0, against a clear gap for shifted ones.
    same, _ = kid(features(200, 5, 4), features(200, 5, 5), subsets=10, subset_size=100)
    assert abs(same) < 0.2 * ours[0]


@pytest.mark.slow  # ~8 s: a full-width Inception-v3, built, saved and loaded
def test_inception_loads_pytorch_fid_layout(tmp_path):
    """Random weights saved under pytorch-fid's names load strictly and give 2048-d features
    that depend on the weights; a partial file is refused with its name."""
    torch.manual_seed(0)
    net = InceptionV3(size=75)
    for module in net.modules():  # non-trivial BatchNorm statistics
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    state = {k: v for k, v in net.state_dict().items() if "num_batches_tracked" not in k}
    path = tmp_path / "pt_inception-test.pth"
    torch.save(state, path)
    extractor = load_features(path, size=75)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    out = extractor(images)
    assert out.shape == (2, 2048) and extractor.identity["kind"] == "inception-v3-fid"
    on_png_levels = ((images + 1) * 127.5).round() / 127.5 - 1
    assert torch.allclose(out, net.eval()(on_png_levels), atol=1e-4)
    torch.save({k: v for k, v in state.items() if not k.startswith("Mixed_7c")}, path)
    with pytest.raises(ValueError, match="pt_inception-test.pth"):
        load_features(path)


def test_missing_features_file_names_it_and_where_to_get_it(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.pth.*pt_inception-2015-12-05"):
        load_features(tmp_path / "nope.pth")


def test_damaged_features_files_and_prompt_files_are_one_line_naming_them(tmp_path):
    net = SmallCNN(num_classes=4, widths=(8, 16), size=8)
    path = tmp_path / "cut.safetensors"
    save_file(net.state_dict(), str(path), metadata=net.metadata())
    path.write_bytes(path.read_bytes()[:-100])  # a download cut short
    with pytest.raises(ValueError, match="cut.safetensors") as err:
        load_features(path)
    assert "\n" not in str(err.value)
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")  # a picture given as the prompt file
    with pytest.raises(ValueError, match=r"prompts=.*prompts.txt: not a UTF-8 text file"):
        read_prompt_file(prompts)


def test_small_cnn_round_trip(tmp_path):
    torch.manual_seed(0)
    net = SmallCNN(num_classes=4, widths=(8, 16), size=8)
    path = tmp_path / "shapes-features.safetensors"
    save_file(net.state_dict(), str(path), metadata=net.metadata())
    extractor = load_features(path)
    images = torch.rand(3, 3, 16, 16) * 2 - 1
    assert extractor(images).shape == (3, 16)
    on_png_levels = ((images + 1) * 127.5).round() / 127.5 - 1
    assert torch.allclose(extractor(images), net.eval()(on_png_levels), atol=1e-6)


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    return make_clip_folder(tmp_path_factory.mktemp("clip"))


def test_clip_score_matches_transformers(clip_folder):
    """Our score equals the cosine transformers' own CLIPModel + CLIPTokenizer give, at the
    model's image size (no resize, so preprocessing is only the normalization)."""
    from transformers import CLIPModel, CLIPTokenizer

    from lun.eval.clip_score import CLIP_MEAN, CLIP_STD, CLIPScorer

    scorer = CLIPScorer(clip_folder)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    prompts = ["a red circle", "a blue square on a white background"]
    ours = scorer(images, prompts)
    model = CLIPModel.from_pretrained(clip_folder).eval()
    tokens = CLIPTokenizer.from_pretrained(clip_folder)(prompts, padding=True, return_tensors="pt")
    pixels = ((images + 1) / 2 - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(
        CLIP_STD
    ).view(3, 1, 1)
    with torch.no_grad():
        out = model(pixel_values=pixels, **tokens)
    cos = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds)
    assert torch.allclose(ours, 100 * cos.clamp(min=0), atol=1e-4)
    assert ours.shape == (2,)


def small_extractor(tmp_path, seed: int = 0, name: str = "features.safetensors"):
    torch.manual_seed(seed)
    net = SmallCNN(num_classes=4, widths=(8, 16), size=16)
    path = tmp_path / name
    save_file(net.state_dict(), str(path), metadata=net.metadata())
    return load_features(path)


def test_reference_features_are_cached_by_content(tmp_path, shapes_dir):
    """Computed once, reused on a rerun; another image's bytes or another extractor's weights
    make another cache entry; a copied folder (same contents elsewhere) reuses it."""
    import shutil

    from lun.eval.reference import extract, reference_features

    extractor = small_extractor(tmp_path)
    spec = {"target": "lun.data.local.Local", "params": {"data_root": str(shapes_dir), "size": 16}}
    cache = tmp_path / "cache"
    first, path, cached = reference_features(spec, extractor, 16, cache_dir=cache)
    assert not cached and first.shape == (16, 16) and path.is_file()
    again, path2, cached = reference_features(spec, extractor, 16, cache_dir=cache)
    assert cached and path2 == path and np.array_equal(again, first)

    copy = tmp_path / "copy"
    shutil.copytree(shapes_dir, copy)
    moved = {**spec, "params": {**spec["params"], "data_root": str(copy)}}
    assert reference_features(moved, extractor, 16, cache_dir=cache)[1:] == (path, True)
    image = sorted((copy / "images").glob("*.png"))[0]
    image.write_bytes(image.read_bytes() + b"\0")  # the same pixels, other bytes
    assert reference_features(moved, extractor, 16, cache_dir=cache)[1] != path
    other = small_extractor(tmp_path, seed=1, name="other.safetensors")
    assert reference_features(spec, other, 16, cache_dir=cache)[1] != path

    # A plain folder: the same images, the same features as the dataset gives.
    folder, _, _ = reference_features(str(shapes_dir / "images"), extractor, 16, cache_dir=cache)
    assert np.allclose(folder, first, atol=1e-5)
    assert extract(extractor, torch.zeros(3, 3, 16, 16), batch_size=2).shape == (3, 16)
