"""docs/configs.md's table of shipped configs names every file under configs/ (a new config
left out of it is a config nobody finds: the SD 3.5 and Flux configs were)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def listed_configs(text: str) -> set[str]:
    """The configs a table row names: `configs/dir/a.yaml`, then `b.yaml` in the same folder."""
    listed = set()
    for row in text.splitlines():
        if not row.startswith("| `configs/"):
            continue
        names = re.findall(r"`([^`]+\.yaml)`", row.split(" | ")[0])
        folder = None
        for name in names:
            if "/" in name:
                folder = str(Path(name).parent)
                listed.add(name)
            elif folder is not None:
                listed.add(f"{folder}/{name}")
    return listed


def test_listed_configs_reads_a_row_with_a_folder_and_bare_names():
    row = "| `configs/sd3/a.yaml`, `b.yaml`, `configs/flux/c.yaml`, `d.yaml` | what |"
    assert listed_configs(row) == {
        "configs/sd3/a.yaml",
        "configs/sd3/b.yaml",
        "configs/flux/c.yaml",
        "configs/flux/d.yaml",
    }


def test_every_shipped_config_is_in_the_configs_page():
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")}
    listed = listed_configs((ROOT / "docs" / "configs.md").read_text())
    assert sorted(shipped - listed) == []
    assert sorted(listed - shipped) == []
