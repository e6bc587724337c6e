"""T5 token counts for the dataset report: the third text encoder of SD 3/3.5 (T5-XXL).

SD3 (Esser et al. 2024, arXiv:2403.03206) conditions on CLIP-L and OpenCLIP bigG (77 tokens each)
and T5-XXL, which diffusers' StableDiffusion3Pipeline reads up to `max_sequence_length` = 256
tokens; a caption longer than that is cut. T5 appends one `</s>` and no start token, so a caption
of 256 tokens as T5 counts them (`</s>` included) fits and 257 is cut.

Where the tokenizer folder is read from, in the model config (nothing is built, no hub):
- a node whose `target` class name contains `T5` (e.g. `ldm.text_encoder_t5.FrozenT5Embedder`,
  SD3Conditioner's `t5xxl` sub-config): its `params.tokenizer`, else `params.version` (the
  local T5 folder, which holds the tokenizer too), and `params.max_length` (default 256);
- a node with `params.t5_version` (a conditioner naming its T5 folder directly): that folder and
  `params.t5_max_length` (default 256).
"""

T5_MAX_LENGTH = 256  # diffusers' StableDiffusion3Pipeline max_sequence_length default


def t5_encoders(model_config) -> list[dict]:
    """{name, tokenizer, error, max_length, unescape} of every T5 text encoder the model config
    names, as `dataset_report.text_encoders` lists CLIP's."""
    found, stack = [], [("model", model_config)]
    while stack:
        key, node = stack.pop()
        if isinstance(node, list):
            stack += [(f"{key}.{i}", v) for i, v in reversed(list(enumerate(node)))]
            continue
        if not isinstance(node, dict):
            continue
        stack += [(f"{key}.{k}", v) for k, v in reversed(list(node.items())) if k != "target"]
        params = node.get("params") if isinstance(node.get("params"), dict) else {}
        target = node.get("target") if isinstance(node.get("target"), str) else ""
        if "T5" in target.rpartition(".")[2]:
            folder = params.get("tokenizer") or params.get("version")
            limit, name, where = params.get("max_length", T5_MAX_LENGTH), target, "version"
        elif "t5_version" in params:
            folder, limit = params["t5_version"], params.get("t5_max_length", T5_MAX_LENGTH)
            name, where = target or "conditioner", "t5_version"
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


def t5_tokenizer(folder, key: str):
    """The tokenizer in a local T5 folder (transformers' AutoTokenizer, offline)."""
    import os

    from transformers import AutoTokenizer

    if not folder or not os.path.isdir(folder):
        raise FileNotFoundError(f"{key}: T5 tokenizer folder '{folder}' does not exist")
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
