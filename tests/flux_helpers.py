"""Tiny Flux.1 models and diffusers' counterparts, shared by tests/ldm/test_flux*.py."""

import torch
from benchmark_flux import diffusers_flux_converter
from diffusers import FluxPipeline, FluxTransformer2DModel
from diffusers.loaders import single_file_utils

from ldm.flux import Flux, lora_targets

tiny_converter = diffusers_flux_converter  # diffusers' converter at a given width

convert = single_file_utils.convert_flux_transformer_checkpoint_to_diffusers


TINY = dict(
    depth=2,
    depth_single_blocks=2,
    hidden_size=48,
    num_heads=2,
    in_channels=4,
    context_dim=20,
    pooled_dim=12,
    axes_dim=(4, 10, 10),
)


def randomise(model: torch.nn.Module) -> None:
    """Non-zero everywhere (adaLN-Zero would hide the blocks); norm scales about 1."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.copy_(torch.randn_like(tensor) * 0.1 + name.endswith(".scale"))


def tiny_pair(guidance: bool = True) -> tuple[Flux, FluxTransformer2DModel]:
    ours = Flux(**TINY, guidance_embed=guidance)
    randomise(ours)
    theirs = FluxTransformer2DModel(
        patch_size=1,
        in_channels=TINY["in_channels"] * 4,
        num_layers=TINY["depth"],
        num_single_layers=TINY["depth_single_blocks"],
        attention_head_dim=TINY["hidden_size"] // TINY["num_heads"],
        num_attention_heads=TINY["num_heads"],
        joint_attention_dim=TINY["context_dim"],
        pooled_projection_dim=TINY["pooled_dim"],
        guidance_embeds=guidance,
        axes_dims_rope=TINY["axes_dim"],
    )
    convert_tiny = tiny_converter(TINY["hidden_size"])
    theirs.load_state_dict(convert_tiny(dict(ours.state_dict())), strict=True)
    return ours, theirs


def diffusers_forward(theirs, x, t, context, pooled, guidance=None):
    """FluxPipeline's own packing and ids; its timestep and guidance in [0, 1] / scale units."""
    b, c, h, w = x.shape
    return theirs(
        hidden_states=FluxPipeline._pack_latents(x, b, c, h, w),
        encoder_hidden_states=context,
        pooled_projections=pooled,
        timestep=t / 1000,
        img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, x.dtype),
        txt_ids=torch.zeros(context.shape[1], 3),
        guidance=guidance,
        return_dict=False,
    )[0]


def ours_and_diffusers(model, theirs, seed: int = 3):
    """(our model's backbone output packed as FluxPipeline packs latents, diffusers'
    transformer's output, their inputs (x, t, context, pooled)) on the same seeded inputs."""
    torch.manual_seed(seed)
    x, context, pooled = torch.randn(2, 16, 8, 12), torch.randn(2, 6, 48), torch.randn(2, 40)
    t = torch.tensor([300.0, 800.0])
    with torch.no_grad():
        adapted = diffusers_forward(theirs, x, t, context, pooled)
        mine = model.backbone(x, t, {"crossattn": context, "vector": pooled})
    return FluxPipeline._pack_latents(mine, *x.shape), adapted, (x, t, context, pooled)


RANK, ALPHA = 4, 8.0  # LoRA scale 2: a lost alpha shows


def with_adapters(model: Flux) -> Flux:
    """peft LoRA on every block Linear, lora_A and lora_B random (a fresh lora_B is zero)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=lora_targets(model))
    inject_adapter_in_model(config, model)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.2)
    return model
