"""DiT (facebookresearch/DiT): the backbone's own names with no prefix (`x_embedder.*`,
`t_embedder.*`, `blocks.N.*`), in the released `.pt` (a flat state dict of the EMA weights) or in
DiT's `train.py` checkpoint (`{"model", "ema", "opt", "args"}`); and diffusers'
DiTTransformer2DModel names of the same weights.
"""

from collections.abc import Mapping

import torch

from ldm.layout.ema import EMA_PREFIX
from ldm.layout.original import MODEL_PARTS
from ldm.safe_load import state_dict_of

# Keys only a DiT has (under the backbone's prefix in our checkpoints, bare in DiT's files).
DIT_KEYS = ("x_embedder.", "t_embedder.")


def is_train_checkpoint(contents: Mapping) -> bool:
    """DiT's `train.py` checkpoint: `{"model", "ema", "opt", "args"}`."""
    return isinstance(contents.get("ema"), Mapping) and isinstance(contents.get("model"), Mapping)


def file_state_keys(contents: Mapping) -> list[str]:
    """The tensor names of a file's contents (a DiT `train.py` checkpoint: its `ema` entry's)."""
    if is_train_checkpoint(contents):
        contents = contents["ema"]
    return list(state_dict_of(contents))


def bare_backbone_state(
    contents: Mapping, backbone: torch.nn.Module, ema: bool | None
) -> dict | None:
    """The weights of a file holding the backbone alone under its own names, else None.

    That is the released DiT `.pt` (a flat state dict of the EMA weights: `x_embedder.proj.weight`,
    `blocks.0.attn.qkv.weight`, ...) or a DiT `train.py` checkpoint, whose `ema` entry is taken
    (its `model` with ema=False), as DiT's sample.py does. The first stage and the schedule are
    not in such files: they come from the config.
    """
    if is_train_checkpoint(contents):
        contents = contents["model"] if ema is False else contents["ema"]
    state = {k: v for k, v in contents.items() if isinstance(v, torch.Tensor)}
    own = backbone.state_dict()
    if any(k.startswith((*MODEL_PARTS, EMA_PREFIX)) for k in state) or not set(state) & set(own):
        return None
    return state


def dit_to_diffusers(state: Mapping) -> dict[str, torch.Tensor]:
    """A DiT state dict (facebookresearch/DiT names, ours) -> diffusers' DiTTransformer2DModel's.

    The renames of diffusers' scripts/convert_dit_to_diffusers.py: the shared timestep and class
    embedders are copied into every block's `norm1.emb`, `qkv` is split into `to_q/to_k/to_v`,
    the final layer becomes `proj_out_1/2`. `pos_embed` is left out: diffusers computes its own
    table. (diffusers' DiT divides the timestep frequencies by half - 1, DiT's code by half: the
    outputs differ slightly unless its `time_proj` uses downscale_freq_shift=0.)
    """
    state = dict(state)
    out = {
        "pos_embed.proj.weight": state.pop("x_embedder.proj.weight"),
        "pos_embed.proj.bias": state.pop("x_embedder.proj.bias"),
        "proj_out_1.weight": state.pop("final_layer.adaLN_modulation.1.weight"),
        "proj_out_1.bias": state.pop("final_layer.adaLN_modulation.1.bias"),
        "proj_out_2.weight": state.pop("final_layer.linear.weight"),
        "proj_out_2.bias": state.pop("final_layer.linear.bias"),
    }
    depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    for i in range(depth):
        new, old = f"transformer_blocks.{i}.", f"blocks.{i}."
        emb = new + "norm1.emb."
        for kind in ("weight", "bias"):
            out[emb + f"timestep_embedder.linear_1.{kind}"] = state[f"t_embedder.mlp.0.{kind}"]
            out[emb + f"timestep_embedder.linear_2.{kind}"] = state[f"t_embedder.mlp.2.{kind}"]
            out[new + f"norm1.linear.{kind}"] = state.pop(old + f"adaLN_modulation.1.{kind}")
            q, k, v = state.pop(old + f"attn.qkv.{kind}").chunk(3, dim=0)
            out.update({new + f"attn1.to_{n}.{kind}": w for n, w in zip("qkv", (q, k, v))})
            out[new + f"attn1.to_out.0.{kind}"] = state.pop(old + f"attn.proj.{kind}")
            out[new + f"ff.net.0.proj.{kind}"] = state.pop(old + f"mlp.fc1.{kind}")
            out[new + f"ff.net.2.{kind}"] = state.pop(old + f"mlp.fc2.{kind}")
        table = state["y_embedder.embedding_table.weight"]
        out[emb + "class_embedder.embedding_table.weight"] = table
    left = sorted(k for k in state if not k.startswith(("t_embedder.", "y_embedder.")))
    if left != ["pos_embed"]:
        raise KeyError(f"not a DiT state dict: {left[:3]} left over")
    return out
