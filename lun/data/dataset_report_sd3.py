"""SD 3/3.5's text encoders for the dataset report: T5-XXL's token counts (256) beside CLIP's.

SD3 (Esser et al. 2024, arXiv:2403.03206) conditions on CLIP-L and OpenCLIP bigG (77 tokens each)
and T5-XXL, which diffusers' StableDiffusion3Pipeline reads up to `max_sequence_length` = 256
tokens; a caption longer than that is cut. T5 appends one `</s>` and no start token, so a caption
of 256 tokens as T5 counts them (`</s>` included) fits and 257 is cut.

Where the tokenizer folder is read from, in the model config (nothing is built, no hub):
- `ldm.conditioning_sd3.SD3Conditioner`'s params: `t5xxl.tokenizer`, else `t5xxl.version`, and
  `t5xxl.max_length`, else `t5_tokens` (default 256); `t5xxl: null` is no T5. Its `clip_l` and
  `clip_g` (77 tokens) are listed too, with the CLIP tokenizer FrozenCLIPEmbedder reads from their
  `tokenizer` / `version` (default: the CLIP BPE file; bigG shares CLIP's vocabulary);
- a node whose `target` class name contains `T5` (e.g. `ldm.text_encoder_t5.FrozenT5Embedder`,
  SD3Conditioner's `t5xxl` sub-config): its `params.tokenizer`, else `params.version` (the
  local T5 folder, which holds the tokenizer too), and `params.max_length` (default 256).
"""

T5_MAX_LENGTH = 256  # diffusers' StableDiffusion3Pipeline max_sequence_length default
CLIP_MAX_LENGTH = 77


def sd3_encoders(model_config) -> list[dict]:
    """{name, tokenizer, error, max_length, unescape} of every T5 text encoder the model config
    names, and of SD3Conditioner's CLIPs, as `dataset_report.text_encoders` lists CLIP's."""
    from lun.config import config_nodes

    found = []
    for key, node in config_nodes(model_config):
        params = node.get("params") if isinstance(node.get("params"), dict) else {}
        target = node.get("target") if isinstance(node.get("target"), str) else ""
        if isinstance(params.get("t5xxl"), dict) or "SD3" in target.rpartition(".")[2]:
            found += sd3_clip_encoders(key, params)
            t5 = params.get("t5xxl")
            if not isinstance(t5, dict):
                continue  # no T5 (t5xxl: null)
            folder = t5.get("tokenizer") or t5.get("version")
            limit = t5.get("max_length", params.get("t5_tokens", T5_MAX_LENGTH))
            name, where = "FrozenT5Embedder", "t5xxl.tokenizer"
        elif "T5" in target.rpartition(".")[2]:
            folder = params.get("tokenizer") or params.get("version")
            limit, name, where = params.get("max_length", T5_MAX_LENGTH), target, "version"
        else:
            continue
        tokenizer, error = None, None
        try:
            tokenizer = t5_tokenizer(folder, f"{key}.params.{where}")
        except (FileNotFoundError, OSError, ValueError) as err:  # say so, go on
            error = str(err).splitlines()[0]
        found.append(
            {
                "name": f"{key} ({name.rpartition('.')[2]})",
                "tokenizer": tokenizer,
                "error": error,
                "max_length": int(limit),
                "unescape": False,
            }
        )
    return found


def sd3_clip_encoders(key: str, params: dict) -> list[dict]:
    """SD3Conditioner's CLIP-L and bigG, as `dataset_report.text_encoders` lists CLIP's."""
    from ldm.text_encoder import clip_tokenizer, clip_tokenizer_folder

    found = []
    for name in ("clip_l", "clip_g"):
        sub = params.get(name) or {}
        try:
            version = sub.get("version") or "openai/clip-vit-large-patch14"
            tokenizer, error = (
                clip_tokenizer(clip_tokenizer_folder(version, sub.get("tokenizer"))),
                None,
            )
        except (FileNotFoundError, OSError) as err:
            tokenizer, error = None, str(err).splitlines()[0]
        found.append(
            {
                "name": f"{key}.params.{name} (CLIP)",
                "tokenizer": tokenizer,
                "error": error,
                "max_length": CLIP_MAX_LENGTH,
                "unescape": False,
            }
        )
    return found


def t5_tokenizer(folder, key: str):
    """The tokenizer in a local T5 folder (transformers' AutoTokenizer, offline)."""
    import os

    from transformers import AutoTokenizer

    if not folder or not os.path.isdir(folder):
        raise FileNotFoundError(f"{key}: T5 tokenizer folder '{folder}' does not exist")
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
