"""The VAE trainer: LPIPS and the loss against the original formulas, the training loop's
options, and float16 stability (ldm/lpips.py, ldm/vae_loss.py, ldm/autoencoder_training.py)."""

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader
from trainer_helpers import quiet_trainer

from ldm.autoencoder_training import AutoencoderKLTraining, autoencoder_kl, psnr, ssim
from ldm.lpips import LPIPS, default_heads_path
from ldm.util import instantiate_from_config
from lun.callbacks.nan_guard import NaNGuard

DDCONFIG = dict(
    double_z=True,
    z_channels=4,
    resolution=32,
    in_channels=3,
    out_ch=3,
    ch=32,
    ch_mult=[1, 2],
    num_res_blocks=1,
    attn_resolutions=[],
    dropout=0.0,
)


def lossconfig(**params):
    # No LPIPS unless a test asks: VGG16 costs seconds per step on 2 cores, and LPIPS has its
    # own tests (perceptual_weight=1 with perceptual_weights="random").
    defaults = dict(
        disc_start=0,
        kl_weight=1e-6,
        disc_weight=0.5,
        perceptual_weight=0.0,
        disc_ndf=8,
        disc_num_layers=2,
    )
    return {"target": "ldm.modules.losses.LPIPSWithDiscriminator", "params": defaults | params}


def make_vae(seed=0, **loss_params) -> AutoencoderKLTraining:
    torch.manual_seed(seed)
    return autoencoder_kl(ddconfig=DDCONFIG, lossconfig=lossconfig(**loss_params), embed_dim=4)


def images(n=4, size=32, seed=1):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# --- LPIPS ------------------------------------------------------------------------------------
RELU_OUTPUTS = (3, 8, 15, 22, 29)  # relu1_2 ... relu5_3 in torchvision's vgg16().features


def reference_lpips(lpips: LPIPS, x, y):
    """Zhang et al. 2018, Eq. 1, written out: unit-normalise each tapped layer along channels,
    squared difference, weight channels by w_l, average over positions, sum over layers."""
    shift = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
    scale = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)
    hx, hy = (x - shift) / scale, (y - shift) / scale
    total = torch.zeros(len(x))
    tap = 0
    for i, layer in enumerate(lpips.features):
        hx, hy = layer(hx), layer(hy)
        if i in RELU_OUTPUTS:
            nx = hx / (hx.pow(2).sum(1, keepdim=True).sqrt() + 1e-10)
            ny = hy / (hy.pow(2).sum(1, keepdim=True).sqrt() + 1e-10)
            w = lpips.lins[tap].weight.view(1, -1, 1, 1)
            total += ((nx - ny) ** 2 * w).sum(1).mean(dim=(1, 2))
            tap += 1
    return total


def test_lpips_is_the_reference_formula_with_random_weights():
    torch.manual_seed(0)
    lpips = LPIPS("random")
    assert all(float(lin.weight.abs().min()) > 0 for lin in lpips.lins)
    x, y = images(2, 16, seed=1), images(2, 16, seed=2)  # relu5_3 is 1x1 at 16 px
    ours = lpips(x, y).flatten()
    torch.testing.assert_close(ours, reference_lpips(lpips, x, y), rtol=1e-5, atol=1e-7)
    assert float(ours.min()) > 0
    assert torch.allclose(lpips(x, x).flatten(), torch.zeros(2), atol=1e-6)


def test_lpips_loads_torchvision_names_and_the_packaged_heads(tmp_path):
    torch.manual_seed(0)
    source = LPIPS("random")
    vgg = {f"features.{k}": v.clone() for k, v in source.features.state_dict().items()}
    vgg["classifier.0.weight"] = torch.zeros(4, 4)  # torchvision's file has more: ignored
    torch.save(vgg, tmp_path / "vgg16-397923af.pth")
    lpips = LPIPS(str(tmp_path / "vgg16-397923af.pth"))
    for name, value in source.features.state_dict().items():
        assert torch.equal(lpips.features.state_dict()[name], value)
    heads = torch.load(default_heads_path(), weights_only=True, map_location="cpu")
    for i, lin in enumerate(lpips.lins):
        assert torch.equal(lin.weight, heads[f"lin{i}.model.1.weight"])
    with pytest.raises(FileNotFoundError, match="missing.pth does not exist"):
        LPIPS(str(tmp_path / "missing.pth"))


def test_missing_vgg_weights_name_the_key(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # no cached torchvision file there
    params = lossconfig(perceptual_weight=1.0, perceptual_weights=None)["params"]
    with pytest.raises(ValueError, match="lossconfig.params.perceptual_weights"):
        instantiate_from_config(
            {"target": "ldm.modules.losses.LPIPSWithDiscriminator", "params": params}
        )


# --- the loss against the original formula ----------------------------------------------------
def reference_generator_loss(vae, x, recs, posterior, kl_weight, disc_weight, factor):
    """LPIPSWithDiscriminator (optimizer_idx 0) as the original defines it (logvar 0,
    perceptual_weight 1)."""
    rec = (x - recs).abs() + vae.loss.perceptual_loss(x, recs)  # LPIPS added to every pixel
    nll = rec.sum() / len(x)
    mean, logvar = posterior.mean, posterior.logvar
    kl = (0.5 * (mean**2 + logvar.exp() - 1 - logvar).sum(dim=(1, 2, 3))).sum() / len(x)
    g = -vae.loss.discriminator(recs).mean()
    last = vae.decoder.conv_out.weight
    nll_grad = torch.autograd.grad(nll, last, retain_graph=True)[0]
    g_grad = torch.autograd.grad(g, last, retain_graph=True)[0]
    d_weight = (nll_grad.norm() / (g_grad.norm() + 1e-4)).clamp(0, 1e4) * disc_weight
    return nll + kl_weight * kl + d_weight * factor * g, d_weight, kl


@pytest.mark.parametrize("step, factor", [(5, 1.0), (2, 0.0)])
def test_generator_loss_is_the_original_formula(step, factor):
    vae = make_vae(disc_start=3, kl_weight=1e-2, perceptual_weight=1.0, perceptual_weights="random")
    x = images(2, 16)
    recs, posterior = vae(x, generator=torch.Generator().manual_seed(3))
    loss, log = vae.loss.generator_loss(x, recs, posterior, step, vae.last_layer())
    expected, d_weight, kl = reference_generator_loss(vae, x, recs, posterior, 1e-2, 0.5, factor)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(log["kl_loss"], kl, rtol=1e-5, atol=1e-6)
    assert log["disc_factor"] == factor
    if factor:
        assert 0 < float(log["d_weight"]) < 5000  # not at the clamp: a real ratio
        torch.testing.assert_close(log["d_weight"], d_weight, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # builds LPIPS's VGG16 (random weights)
def test_training_surrogate_has_the_original_formulas_gradient():
    """The training step backpropagates `generator_surrogate` (split at the reconstructions, so
    FSDP can run it): its gradient on every generator weight, its loss and lambda are those of
    the original formula (reference_generator_loss, lambda from autograd at the last layer)."""
    vae = make_vae(disc_start=3, kl_weight=1e-2, perceptual_weight=1.0, perceptual_weights="random")
    x = images(2, 16)
    generator = [p for n, p in vae.named_parameters() if n.startswith(("encoder", "decoder"))]

    def gradients(loss):
        return torch.autograd.grad(loss, generator, allow_unused=True)

    recs, posterior = vae(x, generator=torch.Generator().manual_seed(3))
    expected, d_weight, _ = reference_generator_loss(vae, x, recs, posterior, 1e-2, 0.5, 1.0)
    want = gradients(expected)
    recs, posterior = vae(x, generator=torch.Generator().manual_seed(3))
    surrogate, log = vae.loss.generator_surrogate(
        x, recs, posterior, 5, vae.decoder.conv_out, vae._last_input
    )
    got = gradients(surrogate)
    torch.testing.assert_close(log["total_loss"], expected.detach(), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(log["d_weight"], d_weight.detach(), rtol=1e-4, atol=1e-6)
    assert 0 < float(log["d_weight"]) < 5000  # not at the clamp: a real ratio
    want, got = torch.cat([w.flatten() for w in want]), torch.cat([g.flatten() for g in got])
    # Float32 sums in another order (biases before a GroupNorm get ~0 +- rounding either way).
    assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("kind", ["hinge", "vanilla"])
def test_discriminator_loss_is_the_original_formula(kind):
    vae = make_vae(disc_start=3, disc_loss=kind)
    x = images()
    recs, _ = vae(x)
    loss, log = vae.loss.discriminator_loss(x, recs, 3)
    real, fake = vae.loss.discriminator(x), vae.loss.discriminator(recs.detach())
    if kind == "hinge":
        expected = 0.5 * (F.relu(1 - real).mean() + F.relu(1 + fake).mean())
    else:
        expected = 0.5 * (F.softplus(-real).mean() + F.softplus(fake).mean())
    torch.testing.assert_close(loss, expected)
    before_start, _ = vae.loss.discriminator_loss(x, recs, 2)
    assert float(before_start) == 0.0 and float(loss) > 0


def test_l2_reconstruction_and_no_perceptual_term():
    vae = make_vae(rec_loss="l2", perceptual_weight=0.0, kl_weight=0.0, disc_start=100)
    assert not hasattr(vae.loss, "perceptual_loss")
    x = images()
    recs, posterior = vae(x)
    loss, _ = vae.loss.generator_loss(x, recs, posterior, 0, vae.last_layer())
    torch.testing.assert_close(loss, (x - recs).pow(2).sum() / len(x))


def test_psnr_and_ssim_known_values():
    x = images(2)
    assert float(ssim(x, x).min()) == pytest.approx(1.0, abs=1e-5)
    noisy = (x + 0.2).clamp(-1, 1)
    mse = ((x - noisy) / 2).pow(2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(psnr(x, noisy), -10 * torch.log10(mse))
    assert float(ssim(x, noisy).max()) < 0.99


# --- the training loop ------------------------------------------------------------------------
def loader(n=8, size=32, seed=1):
    data = [{"image": img} for img in images(n, size, seed)]
    return DataLoader(data, batch_size=2)


def fit(vae, steps, precision="32-true", callbacks=(), n=8, plugins=(), size=16):
    trainer = quiet_trainer(
        plugins=list(plugins), max_steps=steps, precision=precision, callbacks=list(callbacks)
    )
    trainer.fit(vae, loader(n, size))
    return trainer


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def changed(before, module, prefix):
    now = module.state_dict()
    return any(
        not torch.equal(before[k], now[k])
        for k in before
        if k.startswith(prefix) and now[k].is_floating_point()
    )


def test_one_step_per_batch_and_the_discriminator_waits_for_disc_start():
    vae = make_vae(disc_start=3)
    start = snapshot(vae)
    trainer = fit(vae, steps=2)
    assert trainer.global_step == 2  # two batches, not four optimizer steps
    assert changed(start, vae, "encoder.") and changed(start, vae, "decoder.")
    disc_weights = [k for k in start if k.startswith("loss.discriminator.") and "running" not in k]
    disc_weights = [k for k in disc_weights if "num_batches" not in k]
    assert all(torch.equal(start[k], vae.state_dict()[k]) for k in disc_weights)
    trainer = fit(vae, steps=4)  # a new run: steps 0-3, the discriminator trains from step 3
    assert any(not torch.equal(start[k], vae.state_dict()[k]) for k in disc_weights)


def test_train_decoder_only_keeps_the_latent_space():
    torch.manual_seed(0)
    vae = AutoencoderKLTraining(DDCONFIG, lossconfig(), 4, train_decoder_only=True)
    start = snapshot(vae)
    fit(vae, steps=2)
    for frozen in ("encoder.", "quant_conv."):
        assert not changed(start, vae, frozen)
    assert changed(start, vae, "decoder.") and changed(start, vae, "post_quant_conv.")
    assert changed(start, vae, "loss.discriminator.")
    assert {n.split(".")[0] for n, p in vae.ema_module.named_parameters() if p.requires_grad} == {
        "decoder",
        "post_quant_conv",
    }


def test_state_dict_keeps_the_original_names_and_no_lpips():
    vae = make_vae()
    keys = set(vae.state_dict())
    assert {"encoder.conv_in.weight", "decoder.conv_out.weight", "quant_conv.weight"} <= keys
    assert "loss.discriminator.main.0.weight" in keys and "loss.logvar" in keys
    assert not any(k.startswith("loss.perceptual_loss.") for k in keys)
    other = make_vae(seed=5)
    other.load_state_dict(vae.state_dict(), strict=True)
    assert torch.equal(other.decoder.conv_out.weight, vae.decoder.conv_out.weight)


# --- float16 ----------------------------------------------------------------------------------
def overflowing_vae(last_layer_fp32: bool) -> AutoencoderKLTraining:
    """Large activations before the decoder's last layer (x3000) and a discriminator whose
    gradients are comparable to the reconstruction's (x1e5), so lambda is a real ratio."""
    vae = make_vae(seed=0)
    with torch.no_grad():
        vae.decoder.norm_out.weight.mul_(3000.0)
        vae.loss.discriminator.main[-1].weight.mul_(1e5)
    if not last_layer_fp32:  # the state before the fix; the trainer's own default otherwise
        vae.decoder.float32_output = False
    return vae


def adaptive_weight_under(vae, dtype):
    x = images(2, 16)
    enabled = dtype is not None
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=enabled):
        recs, posterior = vae(x, generator=torch.Generator().manual_seed(1))
        loss, log = vae.loss.generator_loss(x, recs, posterior, 10, vae.last_layer())
    return float(log["d_weight"]), float(loss)


def test_fp16_adaptive_weight_needs_the_float32_last_layer():
    reference, _ = adaptive_weight_under(overflowing_vae(True), None)
    assert 1 < reference < 100
    # Before the fix (the last layer under autocast): the pixel-sum gradient overflows float16,
    # lambda jumps to its clamp and the GAN term swamps the loss (it goes hugely negative).
    broken, broken_loss = adaptive_weight_under(overflowing_vae(False), torch.float16)
    assert broken > 10 * reference and broken_loss < 0
    fixed, fixed_loss = adaptive_weight_under(overflowing_vae(True), torch.float16)
    assert fixed == pytest.approx(reference, rel=0.02) and math.isfinite(fixed_loss)
    bf16, _ = adaptive_weight_under(overflowing_vae(True), torch.bfloat16)
    assert bf16 == pytest.approx(reference, rel=0.05)


def test_fp16_kl_of_a_large_logvar_is_finite():
    vae = make_vae()
    with torch.no_grad():
        vae.quant_conv.bias[4:].fill_(15.0)  # logvar ~15: exp(15) = 3.3e6 overflows float16
    x = images()
    with torch.autocast("cpu", dtype=torch.float16):
        recs, posterior = vae(x)
        loss, log = vae.loss.generator_loss(x, recs, posterior, 10, vae.last_layer())
    assert posterior.logvar.dtype == torch.float32
    assert math.isfinite(float(log["kl_loss"])) and float(log["kl_loss"]) > 1e6
    assert math.isfinite(float(loss))


def fp16_plugins() -> list:
    """Lightning turns CPU 16-mixed into bf16: ask for fp16 (and a loss scaler) itself."""
    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]


@pytest.mark.slow
def test_fp16_gradient_scalers_resume(tmp_path):
    """Both scalers come back from a checkpoint (Lightning restores the generator's through the
    precision plugin; the discriminator's is the module's own entry, loaded after `setup`)."""
    vae = make_vae(disc_start=0)
    fit(vae, steps=2, plugins=fp16_plugins(), precision=None, n=4, size=16)
    generator, discriminator = (s.state_dict() for s in vae._grad_scalers)
    assert discriminator["_growth_tracker"] == 2  # two steps on: not a fresh scaler's state
    vae.trainer.save_checkpoint(tmp_path / "vae.ckpt")
    resumed = make_vae(seed=1, disc_start=0)
    trainer = pl.Trainer(
        plugins=fp16_plugins(), accelerator="cpu", max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(resumed, loader(4, 16), ckpt_path=tmp_path / "vae.ckpt")
    assert resumed._grad_scalers[0].state_dict() == generator
    assert resumed._grad_scalers[1].state_dict() == discriminator


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_training_stays_finite(tmp_path, precision):
    torch.manual_seed(0)
    vae = overflowing_vae(True)
    vae.loss.disc_start = 1
    guard = NaNGuard(max_consecutive=1, dirpath=str(tmp_path))
    fp16 = precision == "16-mixed"
    plugins = fp16_plugins() if fp16 else []
    fit(
        vae,
        steps=2,
        precision=None if fp16 else precision,
        callbacks=[guard],
        n=4,
        plugins=plugins,
        size=16,
    )
    assert guard.skipped_steps == 0
    assert all(torch.isfinite(p).all() for p in vae.parameters())
    if fp16:
        generator, discriminator = vae._grad_scalers
        assert generator is not discriminator
        assert generator.get_scale() < 2.0**16  # started below the per-pixel-mean default


# --- original configs -------------------------------------------------------------------------
ORIGINAL_VAE_MODEL = """
base_learning_rate: 4.5e-6
target: ldm.models.autoencoder.AutoencoderKL
params:
  monitor: "val/rec_loss"
  embed_dim: 4
  lossconfig:
    target: ldm.modules.losses.LPIPSWithDiscriminator
    params: {disc_start: 50001, kl_weight: 0.000001, disc_weight: 0.5}
  ddconfig:
    double_z: True
    z_channels: 4
    resolution: 256
    in_channels: 3
    out_ch: 3
    ch: 128
    ch_mult: [ 1,2,4,4 ]
    num_res_blocks: 2
    attn_resolutions: [ ]
    dropout: 0.0
"""  # the model section of CompVis' autoencoder_kl_32x32x4.yaml (shared/reference/configs)


def test_original_training_config_model_section_builds_unchanged(monkeypatch):
    import yaml

    from ldm import vae_loss

    monkeypatch.setattr(vae_loss, "default_vgg16_path", lambda: "random")  # as if cached
    vae = instantiate_from_config(yaml.safe_load(ORIGINAL_VAE_MODEL))
    assert isinstance(vae, AutoencoderKLTraining) and isinstance(vae, pl.LightningModule)
    assert vae.loss.disc_start == 50001 and vae.loss.disc_weight == 0.5
    assert vae.latent_shape(256, 256) == (4, 32, 32)


def test_first_stage_trainable_is_accepted_and_the_vae_stays_frozen(caplog):
    from ldm.util import latent_diffusion_params

    first_stage = {
        "target": "ldm.models.autoencoder.AutoencoderKL",
        "params": {"lossconfig": lossconfig()},
    }
    with caplog.at_level("WARNING", logger="ldm.compat"):
        params = latent_diffusion_params(
            {"first_stage_trainable": True, "first_stage_config": first_stage}
        )
    assert "first_stage_trainable" not in params
    assert params["first_stage_config"]["params"]["lossconfig"] is None
    warnings = [r.getMessage() for r in caplog.records]
    assert any("first_stage_trainable: true" in w and "not optimised" in w for w in warnings)
    assert any("lossconfig" in w and "no effect" in w for w in warnings)


def test_the_discriminator_step_sees_the_updated_generators_reconstructions():
    """The original ran training_step again for optimizer_idx 1, after the generator's step: the
    discriminator's fakes come from the updated weights, not from the generator's forward."""
    vae = make_vae(disc_start=0)
    vae.learning_rate = 1e-2  # a step that visibly moves the reconstructions
    with torch.no_grad():  # a posterior of std exp(-15): its sample is the mean (no noise)
        half = vae.quant_conv.out_channels // 2
        vae.quant_conv.weight[half:] = 0.0
        vae.quant_conv.bias[half:] = -30.0
    x = images(2, 16)  # the one batch fit() trains on
    before = vae(x, sample_posterior=False)[0].detach()
    seen = []
    vae.loss.discriminator.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    fit(vae, steps=1, n=2)
    after = vae(x, sample_posterior=False)[0].detach()
    fake = seen[-1]  # discriminator_loss: D(real), then D(fake)
    assert torch.allclose(fake, after, atol=1e-4)
    assert not torch.allclose(fake, before, atol=1e-2)


def test_ema_checkpoint_keeps_the_original_names_saved_inside_an_ema_block(tmp_path):
    """Saved while the EMA weights are swapped in (validation, the image logger): the raw weights
    stay under the VAE's own names and the shadows under LitEma's rule (`model_ema.` + the name
    without dots), so the file loads as a VAE and `swap_vae.py --ema` finds the average."""
    from safetensors.torch import load_file
    from swap_vae import main as swap_vae

    from ldm.autoencoder import AutoencoderKL
    from lun.callbacks.ema import EMA, ema_weights

    vae = make_vae()
    vae.learning_rate = 1e-2
    trainer = fit(vae, steps=2, callbacks=[EMA(decay=0.5, async_update=False)])
    raw = snapshot(vae)
    with ema_weights(trainer, vae):
        averaged = snapshot(vae)
        trainer.save_checkpoint(tmp_path / "vae.ckpt")
    state = torch.load(tmp_path / "vae.ckpt", weights_only=True)["state_dict"]
    assert not any(k.startswith("model.") for k in state)
    name = "decoder.conv_out.weight"
    assert torch.equal(state[name], raw[name])
    assert torch.equal(state["model_ema.decoderconv_outweight"], averaged[name])
    assert not torch.equal(raw[name], averaged[name])
    AutoencoderKL(DDCONFIG, 4, ckpt_path=str(tmp_path / "vae.ckpt"))  # strict: the raw weights
    out = tmp_path / "ema.safetensors"
    assert swap_vae(["--vae", str(tmp_path / "vae.ckpt"), "--ema", "--out", str(out)]) == 0
    assert torch.equal(load_file(out)[name], averaged[name])
    # Training resumes from it (the shadows go to the EMA callback, not the module).
    resumed = make_vae(seed=1)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[EMA(decay=0.5, async_update=False)],
    )  # fmt: skip
    trainer.fit(resumed, loader(8, 16), ckpt_path=tmp_path / "vae.ckpt")
    assert trainer.global_step == 3
