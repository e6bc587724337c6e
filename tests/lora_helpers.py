"""Shared by the LoRA tests: tiny models with a "pretrained" base and random adapters."""

import torch

from ldm import lora
from ldm.layout.peft import LORA_PREFIX, is_adapter_name
from ldm.util import instantiate_from_config
from lun.config import merge_configs, to_container

LOCON_DORA = "{rank: 2, alpha: 1, targets: [attn, proj, ff, conv], conv_rank: 3, conv_alpha: 6, dora: true, text_encoder: {rank: 2, alpha: 4}}"


def build(config, lora_settings: str | None, seed: int = 0, overrides: tuple[str, ...] = ()):
    """The tiny model with a "pretrained" base: every base weight moved by seeded noise (the
    fresh UNet's zero-initialised output layer would hide everything), the same with and
    without adapters; fresh adapters (B = 0) on it. `overrides`: dotlist of the config."""
    dotlist = [*overrides, *([f"model.params.lora={lora_settings}"] if lora_settings else [])]
    torch.manual_seed(seed)
    model = instantiate_from_config(to_container(merge_configs([config], dotlist))["model"])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_adapter_name(name) and param.device.type != "meta":
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    if lora_settings and next(model.parameters()).device.type != "meta":
        lora.after_loading(model, {})  # DoRA magnitudes: the norms of the moved base
    return model


def randomize_adapters(model, seed: int = 1) -> None:
    """Nonzero lora_B (peft starts it at zero, which would hide a wrong up/down or scale) and
    DoRA magnitudes away from the base norms."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            elif ".lora_magnitude_vector." in name:
                param.mul_(1 + 0.5 * torch.rand(param.shape, generator=generator))


def unet_output(model, seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 8, generator=generator)
    t = torch.tensor([10, 500])
    context = torch.randn(2, 77, 32, generator=generator)
    with torch.no_grad():
        return model.apply_model(x, t, {"crossattn": context})


# --- our LoRA model beside diffusers' pipeline of the same base (interop tests) ----------------

PROMPT = "a red circle on a blue background"


def pipeline_of_base(model, tiny_config, folder):
    """A diffusers pipeline of `model`'s base weights, made by our --to-diffusers export."""
    import convert  # scripts/convert.py
    import diffusers

    saved = {"state_dict": model.state_dict()}
    lora.save_layout(model, saved)
    base = {k: v for k, v in saved["state_dict"].items() if not k.startswith(LORA_PREFIX)}
    convert.export_diffusers(base, to_container(merge_configs([tiny_config])), folder)
    return diffusers.StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)


def outputs_of_ours(model, x, t, context):
    with torch.no_grad():
        return model.apply_model(x, t, {"crossattn": context}), model.conditioner([PROMPT])


def outputs_of_pipeline(pipe, x, t, context):
    with torch.no_grad():
        unet = pipe.unet(x, t, encoder_hidden_states=context).sample
        tokens = pipe.tokenizer([PROMPT], padding="max_length", max_length=77, return_tensors="pt")
        text = pipe.text_encoder(tokens.input_ids).last_hidden_state
    return unet, text


def inputs(seed: int = 4):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, 4, 8, 8, generator=generator),
        torch.tensor([20, 700]),
        torch.randn(2, 77, 32, generator=generator),
    )
