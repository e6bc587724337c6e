"""Convert a training checkpoint into the files other tools load.

    # original-layout .safetensors (ComfyUI, AUTOMATIC1111, diffusers from_single_file)
    python scripts/convert.py logs/<run>/checkpoints/last.ckpt model.safetensors --ema --half
    # a diffusers pipeline folder (needs `pip install diffusers`): SD 1.x / 2.x, SDXL, or SD 3 / 3.5
    python scripts/convert.py logs/<run>/checkpoints/last.ckpt --to-diffusers out/pipeline
    # a diffusers folder back to one original-layout file (SD 1.x/2.x/XL: with --config)
    python scripts/convert.py out/pipeline model.safetensors

The checkpoint may be a file or the folder that DeepSpeed (any ZeRO stage) or sharded FSDP write:
its shards are merged into one float32 state dict in CPU memory first, so the output is always
one file in the original layout.

A checkpoint file is memory-mapped and written out one tensor at a time, so converting a
full-size checkpoint needs little more memory than its largest tensor (`.safetensors` output;
a `.ckpt` output with --half / --bf16 holds the cast weights).

--ema writes the EMA weights as the model weights; --prune keeps weights only (drops EMA shadows,
optimizer and loop state); --half / --bf16 store floating weights in fp16 / bf16 (the DDPM schedule
stays float32).
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
from pathlib import Path
from typing import TYPE_CHECKING

from lun.cli import HelpFormatter, check_output_file, check_output_folder

if TYPE_CHECKING:
    import torch
# The heavy modules (torch, the models) are imported in the functions: --help answers at once.


# What `out` may be: safetensors, or a torch pickle under one of its usual names (any other
# name, a typo of `.safetensors` say, would silently get a pickle).
OUTPUT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")


def convert_state(state: dict, ema: bool, prune: bool) -> dict:
    """EMA shadows -> model weights (`ema`), EMA shadows dropped (`prune` or `ema`)."""
    from ldm.layout import ema as ema_layout
    from ldm.layout.original import backbone_names

    if ema:
        if not ema_layout.has_ema(state):
            raise KeyError(f"--ema: the checkpoint has no EMA weights ({ema_layout.EMA_PREFIX}*)")
        return ema_layout.apply_ema(state, backbone_names(state))
    if prune:
        return ema_layout.without_shadows(state)
    return state


# Not weights: the DDPM schedule and the EMA decay stay float32 under --half / --bf16. In fp16
# alphas_cumprod[0] = 0.99915 rounds to 0.99902 (samples drift from diffusers' 60x more) and an
# EMA decay of 0.9999 rounds to 1.0 (a resumed EMA would never move).
@functools.cache
def full_precision() -> frozenset[str]:
    from ldm.layout.ema import EMA_SCALARS
    from ldm.schedule import SCHEDULE_BUFFER_NAMES

    return frozenset(SCHEDULE_BUFFER_NAMES) | frozenset(EMA_SCALARS)


def cast_weights(state: dict, dtype) -> dict:
    """Floating weights cast to `dtype` (None: unchanged); the `full_precision()` entries are kept."""
    if dtype is None:
        return state
    return {k: v.to(dtype) if _cast(k, v) else v for k, v in state.items()}


def _cast(key: str, tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and key not in full_precision()


def save_checkpoint_file(state: dict, path: Path, dtype, contents: dict, prune: bool) -> None:
    from ldm import checkpoint
    from lun.generation import writing

    if path.suffix == ".safetensors":
        # One tensor at a time, cast as it is written: no copy of the model in memory.
        with writing(path):
            checkpoint.save_safetensors(
                state, path, dtype, metadata={"format": "pt"}, keep=full_precision()
            )
        return
    state = cast_weights(state, dtype)
    kept = {} if prune else {k: v for k, v in contents.items() if k != "state_dict"}
    tmp = checkpoint.temporary_path(path)
    with writing(path):
        _torch_save(
            {**kept, "state_dict": state, "global_step": contents.get("global_step", 0)}, tmp
        )
    tmp.replace(path)


def _torch_save(obj, path: Path) -> None:
    """torch.save through a Python file, so a failed write (a full disk) surfaces as its OSError
    rather than torch's "[enforce fail at inline_container.cc] unexpected pos"."""
    import torch

    failed = []

    class Sink:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            try:
                return self.file.write(data)
            except OSError as err:
                failed.append(err)
                raise

        def flush(self):
            self.file.flush()

    try:
        with open(path, "wb") as file:
            torch.save(obj, Sink(file))
    except BaseException as err:
        path.unlink(missing_ok=True)
        if failed and isinstance(err, RuntimeError):
            raise failed[0] from None
        raise


def diffusers_prediction_type(parameterization: str) -> str:
    """The scheduler's `prediction_type` for our parameterization. A rectified-flow model has
    none in the SD / SDXL pipelines (their schedulers are DDPM-family): refused in one line."""
    types = {"eps": "epsilon", "v": "v_prediction"}
    if parameterization not in types:
        raise ValueError(
            f"--to-diffusers: a {parameterization!r} model has no StableDiffusion(XL)Pipeline "
            "scheduler; write the original layout instead (convert.py CKPT OUT.safetensors)"
        )
    return types[parameterization]


def export_diffusers(state: dict, original: dict, out_dir: Path) -> None:
    """Write a `StableDiffusionPipeline` (SDXL: `StableDiffusionXLPipeline`) folder with
    diffusers' own converters.

    `original`: the model's config as a dict (`{"model": {"target", "params"}}`)."""
    from ldm.layout import family
    from ldm.layout.original import OPENCLIP_PREFIX, to_transformers_clip
    from ldm.util import instantiate_from_config

    try:
        from diffusers import DDIMScheduler, StableDiffusionPipeline
        from diffusers.loaders import single_file_utils as sfu
    except ImportError:
        raise ImportError("--to-diffusers needs diffusers: pip install diffusers") from None
    from transformers import CLIPTextModel

    found = family.model_family(state)
    if found == family.SD3:
        from convert_sd3 import export_sd3

        return export_sd3(state, original, out_dir)
    if found not in (family.SD1, family.SD2, family.SDXL):
        raise ValueError(
            f"--to-diffusers writes SD 1.x, 2.x, SDXL and SD 3 pipelines; this is {family.a(found)} "
            "model: write the original layout instead (convert.py CKPT OUT.safetensors)"
        )
    params = original["model"]["params"]
    model = instantiate_from_config({**original["model"], "params": {**params, "ckpt_path": None}})
    encoder = model.caption_conditioner
    if family.is_sdxl(original["model"]):
        return export_sdxl(state, original, model, out_dir)
    if not hasattr(encoder, "transformer") and not hasattr(encoder, "encode_with_transformer"):
        raise ValueError("--to-diffusers supports the SD 1.x, 2.x and SDXL text encoders")

    unet = diffusers_unet(state, original)
    vae = diffusers_vae(state, original, model.latent_scaling[0])
    if hasattr(encoder, "transformer"):  # SD 1.x: OpenAI CLIP
        text_encoder = CLIPTextModel(encoder.transformer.config)
        clip_state = sfu.convert_ldm_clip_checkpoint(state)
        tokenizer = encoder.tokenizer
    else:  # SD 2.x: the OpenCLIP tower as transformers' CLIP, as diffusers' SD 2 folders hold it
        # Like diffusers' SD 2 folders it stops where the conditioning is taken (the
        # penultimate block): its `last_hidden_state` is SD 2's context.
        tower = encoder.model
        blocks = len(tower.transformer.resblocks) - encoder.LAYERS[encoder.layer]
        text_encoder, clip_state = open_clip_as_transformers(
            tower, state, sfu, OPENCLIP_PREFIX, blocks
        )
        tokenizer = copy.deepcopy(encoder.tokenizer)
        tokenizer.pad_token = "!"  # id 0: open_clip pads with zeros (diffusers' SD 2 tokenizer)
    text_encoder.load_state_dict(to_transformers_clip(clip_state, text_encoder))
    scheduler = DDIMScheduler(
        **diffusers_schedule(params),
        num_train_timesteps=model.num_timesteps,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        timestep_spacing="leading",
        prediction_type=diffusers_prediction_type(model.parameterization),
    )
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)


def diffusers_unet(state: dict, original: dict):
    """The UNet as diffusers' `UNet2DConditionModel`, config and weights by its converters."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders import single_file_utils as sfu

    from ldm.layout import family

    config = sfu.create_unet_diffusers_config_from_ldm(original, state)
    if family.is_sdxl(original["model"]):
        # diffusers tells SDXL by its context width (2048 or 1280) and fixes the size features
        # at 256 channels; ours come from the model's config, so reduced widths export too.
        size_dim = _sdxl_size_embedders(original)[0]["params"].get("outdim", 256)
        config.update(class_embed_type=None, addition_embed_type="text_time")
        config.update(addition_time_embed_dim=size_dim)
    unet = UNet2DConditionModel(**config)
    unet.load_state_dict(sfu.convert_ldm_unet_checkpoint(state, config))
    return unet


def diffusers_vae(state: dict, original: dict, scale_factor: float):
    from diffusers import AutoencoderKL
    from diffusers.loaders import single_file_utils as sfu

    config = sfu.create_vae_diffusers_config_from_ldm(original, state, scaling_factor=scale_factor)
    vae = AutoencoderKL(**config)
    vae.load_state_dict(sfu.convert_ldm_vae_checkpoint(state, config))
    return vae


def _sdxl_size_embedders(original: dict) -> list:
    embedders = original["model"]["params"]["conditioner_config"]["params"]["emb_models"]
    return [e for e in embedders if e["target"].endswith("ConcatTimestepEmbedderND")]


def export_sdxl(state: dict, original: dict, model, out_dir: Path) -> None:
    """Write a `StableDiffusionXLPipeline` folder: `text_encoder` (CLIP ViT-L, a `CLIPTextModel`),
    `text_encoder_2` (the OpenCLIP tower as a `CLIPTextModelWithProjection`, all its blocks: the
    pipeline takes `hidden_states[-2]` of both and the projected pooled output of the second),
    their tokenizers, `EulerDiscreteScheduler` as SDXL base 1.0's `model_index.json` has it.
    Not stored (diffusers has no place for it): the OpenCLIP `logit_scale`, used by CLIP's
    contrastive loss only."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from diffusers.loaders import single_file_utils as sfu
    from transformers import CLIPTextModel

    from ldm.layout.original import SGM_OPENCLIP_PREFIX, to_transformers_clip
    from ldm.util import PARAM_TRANSLATIONS

    check_sdxl_exportable(model, original)
    params = original["model"]["params"]
    if "network_config" not in params:  # our own names: diffusers' converters read sgm's
        params = {**params, "network_config": params["backbone_config"]}
    sgm = {"model": {**original["model"], "params": params}}
    clip, open_clip = model.caption_conditioner.embedders[:2]
    text_encoder = CLIPTextModel(clip.transformer.config)
    clip_state = sfu.convert_ldm_clip_checkpoint(state)
    text_encoder.load_state_dict(to_transformers_clip(clip_state, text_encoder))
    tower = open_clip.model
    blocks = len(tower.transformer.resblocks)
    text_encoder_2, clip_state = open_clip_as_transformers(
        tower, state, sfu, SGM_OPENCLIP_PREFIX, blocks, projection=True
    )
    text_encoder_2.load_state_dict(to_transformers_clip(clip_state, text_encoder_2))
    tokenizer_2 = copy.deepcopy(open_clip.tokenizer)
    tokenizer_2.pad_token = "!"  # id 0: open_clip pads with zeros (diffusers' SDXL tokenizer_2)

    translate = PARAM_TRANSLATIONS.get(original["model"]["target"])
    schedule = diffusers_schedule(translate(params) if translate else params)
    scheduler = EulerDiscreteScheduler(  # sd_xl_base_1.0's scheduler_config.json
        **schedule,
        num_train_timesteps=model.num_timesteps,
        steps_offset=1,
        timestep_spacing="leading",
        interpolation_type="linear",
        use_karras_sigmas=False,
        prediction_type=diffusers_prediction_type(model.parameterization),
    )
    # DDIM's settings, which sd_xl_base_1.0's Euler config carries too: a user's
    # `DDIMScheduler.from_config(pipe.scheduler.config)` then samples as our DDIM does.
    scheduler.register_to_config(clip_sample=False, set_alpha_to_one=False)
    pipeline = StableDiffusionXLPipeline(
        vae=diffusers_vae(state, sgm, model.latent_scaling[0]),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=clip.tokenizer,
        tokenizer_2=tokenizer_2,
        unet=diffusers_unet(state, sgm),
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,  # as our txt2img: no negative prompt -> zeros
        add_watermarker=False,  # our images carry none
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)


def check_sdxl_exportable(model, original: dict) -> None:
    """What `StableDiffusionXLPipeline` computes must be what the model computes: CLIP's and
    OpenCLIP's penultimate layers, OpenCLIP's pooled output, then original size, crop and target
    size (each Fourier-embedded at the same width)."""
    from ldm.conditioning_xl import CAPTION_KEY, SIZE_KEYS

    embedders = model.caption_conditioner.embedders
    keys = [e.input_key for e in embedders]
    want = [CAPTION_KEY, CAPTION_KEY, *SIZE_KEYS]
    if keys != want:
        raise ValueError(
            f"--to-diffusers: SDXL conditioner inputs {keys}, the pipeline's are {want}"
        )
    clip, open_clip = embedders[:2]
    layers = clip.transformer.config.num_hidden_layers
    if clip.layer != "hidden" or clip.layer_idx != layers - 1:
        raise ValueError(
            "--to-diffusers: StableDiffusionXLPipeline takes CLIP's penultimate layer (layer: "
            f"hidden, layer_idx: {layers - 1}); this model has layer {clip.layer} "
            f"{clip.layer_idx}"
        )
    if open_clip.layer != "penultimate" or open_clip.legacy or not open_clip.always_return_pooled:
        raise ValueError(
            "--to-diffusers: the second text encoder must be sgm's SDXL one (layer: penultimate, "
            "legacy: false, always_return_pooled: true)"
        )
    dims = {e["params"].get("outdim", 256) for e in _sdxl_size_embedders(original)}
    if len(dims) != 1:
        raise ValueError(f"--to-diffusers: the size embedders' outdim differ ({sorted(dims)})")


def diffusers_schedule(params: dict) -> dict:
    """The model's schedule settings in diffusers' words. The config's values, not the float32
    `betas` buffer's ends, so that a folder read back rebuilds the same buffers bit for bit."""
    from ldm.schedule import schedule_betas
    from ldm.util import latent_diffusion_params

    defaults = inspect.signature(schedule_betas).parameters
    schedule = {k: v.default for k, v in defaults.items()}
    schedule.update(latent_diffusion_params(params).get("schedule") or {})
    names = {"linear": "scaled_linear", "scaled_linear": "scaled_linear", "sqrt_linear": "linear"}
    names.update({"cosine": "squaredcos_cap_v2", "squaredcos_cap_v2": "squaredcos_cap_v2"})
    if schedule["beta_schedule"] not in names:
        raise ValueError(
            f"--to-diffusers: beta_schedule {schedule['beta_schedule']} has no diffusers name"
        )
    return {
        "beta_start": schedule["linear_start"],
        "beta_end": schedule["linear_end"],
        "beta_schedule": names[schedule["beta_schedule"]],
        "rescale_betas_zero_snr": bool(schedule["zero_terminal_snr"]),
    }


def open_clip_as_transformers(tower, state: dict, sfu, prefix: str, blocks: int, projection=False):
    """The OpenCLIP tower (`<prefix>*`, its first `blocks` blocks) as a transformers
    `CLIPTextModel` (`projection`: `CLIPTextModelWithProjection`), by diffusers'
    `convert_open_clip_checkpoint`. The blocks after `blocks`, `logit_scale` (and without
    `projection`, `text_projection`) have no place in that model."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    width = tower.ln_final.normalized_shape[0]
    config = CLIPTextConfig(
        vocab_size=tower.token_embedding.num_embeddings,
        hidden_size=width,
        intermediate_size=tower.transformer.resblocks[0].mlp.c_fc.out_features,
        num_hidden_layers=blocks,
        num_attention_heads=tower.transformer.resblocks[0].attn.heads,
        max_position_embeddings=tower.positional_embedding.shape[0],
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        projection_dim=tower.text_projection.shape[1],
        bos_token_id=49406,
        eos_token_id=49407,  # pooled at the first <eot>: open_clip pads with 0 after it
        pad_token_id=0,
    )
    from ldm.layout.original import OPENCLIP_BLOCKS

    unused = tuple(f"{prefix}{OPENCLIP_BLOCKS}{i}." for i in range(blocks, 10_000))
    kept = {k: v for k, v in state.items() if k.startswith(prefix) and not k.startswith(unused)}
    text_encoder = (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)
    converted = sfu.convert_open_clip_checkpoint(text_encoder, kept, prefix=prefix)
    if not projection:
        converted.pop("text_projection.weight", None)  # a CLIPTextModel has no projection
    return text_encoder, converted


def diffusers_folder_state(folder: Path, config: Path, unsafe: bool) -> dict:
    """A diffusers folder in the original layout, checked against the model `config` builds
    (on the meta device: only its names, shapes and settings are needed)."""
    import torch

    from ldm import checkpoint
    from ldm.layout import diffusers
    from ldm.util import instantiate_from_config
    from lun.config import merge_configs, to_container

    params = to_container(merge_configs([config]))["model"]
    params["params"].pop("ckpt_path", None)
    with torch.device("meta"):
        model = instantiate_from_config(params)
    state, info = diffusers.original_state(folder, unsafe)
    diffusers.check_model(model, folder, info, state)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise KeyError(checkpoint.mismatch_message(folder, missing, []))
    return state


def check_convertible(args, keys: list[str]) -> None:
    """A model checkpoint, of the config's family when a config is given or needed (before
    anything is written): a LoRA file or another family's file is one line naming both."""
    from ldm import checkpoint
    from ldm.layout import family
    from lun.config import merge_configs, to_container
    from lun.generation import find_config

    found = family.model_family(keys)
    if found == family.LORA:
        expected = "a model checkpoint (a run's .ckpt or an SD checkpoint)"
        checkpoint.check_family(args.ckpt, found, "model", "ckpt", expected)
    if args.config or args.to_diffusers:
        configs = [args.config] if args.config else find_config(Path(args.ckpt))
        expected = family.model_family(to_container(merge_configs(configs))["model"])
        checkpoint.check_family(args.ckpt, found, expected, "ckpt")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "ckpt",
        help="our Lightning .ckpt file or DeepSpeed/FSDP folder (or any SD checkpoint), or a "
        "diffusers folder (with --config)",
    )
    parser.add_argument("out", nargs="?", help="output .safetensors or .ckpt")
    parser.add_argument(
        "--ema", action="store_true", help="write the EMA weights as the model weights"
    )
    parser.add_argument(
        "--prune", action="store_true", help="weights only: no EMA shadows, optimizer, loops"
    )
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--half", action="store_true", help="store floating weights as fp16")
    precision.add_argument("--bf16", action="store_true", help="store floating weights as bf16")
    parser.add_argument(
        "--to-diffusers", metavar="DIR", help="also write a diffusers pipeline folder"
    )
    parser.add_argument("--config", help="model config (default: the run folder's saved config)")
    parser.add_argument(
        "--unsafe-load", action="store_true", help="allow pickled code (trusted files only)"
    )
    args = parser.parse_args(argv)
    if not args.out and not args.to_diffusers:
        parser.error("give an output file, --to-diffusers DIR, or both")
    import torch

    from ldm.layout.diffusers import is_diffusers_folder
    from ldm.layout.dit import file_state_keys
    from ldm.layout.ema import without_ema
    from ldm.layout.family import SD3, diffusers_family
    from ldm.layout.family import model_family as family_of
    from ldm.safe_load import state_dict_of
    from lun.config import merge_configs, to_container
    from lun.generation import (
        check_text_file,
        find_config,
        one_line_errors,
        replaced_folder,
        writing,
    )
    from lun.strategies import load_training_checkpoint

    with one_line_errors():  # one line naming the file, exit 2 (1 for a failed write)
        if args.out:  # before anything is read: a mistyped name is not found after an hour
            check_output_file(args.out, "out", OUTPUT_SUFFIXES)
        if args.to_diffusers:
            check_output_folder(args.to_diffusers, "--to-diffusers")
        if args.config:
            check_text_file(Path(args.config), "--config")
        if diffusers_family(args.ckpt) == SD3:  # needs no config: its names say it all
            from convert_sd3 import folder_state

            contents = {"state_dict": folder_state(Path(args.ckpt), args.unsafe_load)}
        elif is_diffusers_folder(args.ckpt):  # in: a diffusers folder, out: the original layout
            if not args.config:
                raise ValueError(f"{args.ckpt}: a diffusers folder needs --config")
            state = diffusers_folder_state(Path(args.ckpt), args.config, args.unsafe_load)
            contents = {"state_dict": state}
        else:
            # Memory-mapped: a tensor is read when it is written out (optimizer state never).
            contents = load_training_checkpoint(args.ckpt, unsafe=args.unsafe_load, mmap=True)
        check_convertible(args, file_state_keys(contents))
        state = convert_state(state_dict_of(contents), args.ema, args.prune)
        dtype = torch.float16 if args.half else torch.bfloat16 if args.bf16 else None
        if args.to_diffusers:  # checked before anything is written
            configs = [args.config] if args.config else find_config(Path(args.ckpt))
            original = to_container(merge_configs(configs))
            if family_of(original["model"]) != SD3:  # SD3's scheduler is rectified flow's
                diffusers_prediction_type(
                    original["model"]["params"].get("parameterization", "eps")
                )
        if args.out:
            save_checkpoint_file(state, Path(args.out), dtype, contents, args.prune or args.ema)
            print(f"wrote {args.out} ({len(state)} tensors)")
        if args.to_diffusers:
            with writing(args.to_diffusers), replaced_folder(args.to_diffusers) as folder:
                export_diffusers(without_ema(state), original, folder)
            print(f"wrote diffusers pipeline to {args.to_diffusers}")


if __name__ == "__main__":
    from lun import quiet

    quiet.install()  # known third-party noise (lun/quiet.py)
    main()
