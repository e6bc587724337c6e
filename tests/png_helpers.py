"""AUTOMATIC1111's reading of a PNG's parameters text, restated (shared by the PNG and LoRA tests)."""

import re

# AUTOMATIC1111 modules/infotext_utils.py: one `key: value` pair of the last line.
A1111_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
A1111_IMAGE_SIZE = re.compile(r"^(\d+)x(\d+)$")


def parse_a1111_parameters(text: str) -> dict[str, str]:
    """AUTOMATIC1111's rules: prompt line(s), then an optional "Negative prompt: " line (and the
    lines after it), then a last line of at least 3 `key: value` pairs; "WxH" values split into
    `key-1` (width) and `key-2` (height)."""
    *lines, last = text.strip().split("\n")
    if len(A1111_PARAM.findall(last)) < 3:  # no parameter line: it is part of the prompt
        lines.append(last)
        last = ""
    prompt, negative, in_negative = [], [], False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            in_negative = True
            line = line[len("Negative prompt:") :].strip()
        (negative if in_negative else prompt).append(line)
    fields = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    for key, value in A1111_PARAM.findall(last):
        size = A1111_IMAGE_SIZE.match(value)
        if size:
            fields[f"{key}-1"], fields[f"{key}-2"] = size.groups()
        else:
            fields[key] = value
    return fields
