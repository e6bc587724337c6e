"""scripts/plant_bugs.py: a planted bug that its test sees is "caught", one it does not is
"MISSED" (exit 1), as is one that only breaks an import, and the tree itself is left as it was."""

from pathlib import Path

import plant_bugs
import yaml

MODULE = "def add(a, b):\n    return a + b\n\n\ndef unused(a):\n    return a * 2\n"
TEST = "from mod import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def tree(tmp_path, bugs):
    root = tmp_path / "tree"
    (root / "tests").mkdir(parents=True)
    (root / "mod.py").write_text(MODULE)
    (root / "tests" / "test_mod.py").write_text(TEST)
    (tmp_path / "bugs.yaml").write_text(yaml.safe_dump(bugs))
    return root


def bug(name, old, new):
    return {"name": name, "file": "mod.py", "old": old, "new": new, "tests": "tests/test_mod.py"}


def test_caught_and_missed_bugs_are_told_apart(tmp_path, capsys):
    bugs = [
        bug("sign", "a + b", "a - b"),
        bug("unused", "a * 2", "a * 3"),
        bug("syntax", "return a + b", "return a +"),  # a collection error, not a failing test
    ]
    root = tree(tmp_path, bugs)
    assert plant_bugs.main([str(tmp_path / "bugs.yaml"), "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "caught  sign" in out and "MISSED  unused" in out and "MISSED  syntax" in out
    assert "1 of 3 caught" in out
    assert (root / "mod.py").read_text() == MODULE  # planted on a scratch copy only


def test_a_bug_whose_text_is_not_there_is_refused(tmp_path, capsys):
    root = tree(tmp_path, [bug("nowhere", "a / b", "a // b")])
    assert plant_bugs.main([str(tmp_path / "bugs.yaml"), "--root", str(root)]) == 2
    assert "nowhere" in capsys.readouterr().out


def test_every_listed_bug_still_finds_its_text_once():
    """The lists under tests/planted name texts of the code; a change of that code leaves an
    entry that can no longer be planted (plant_bugs then stops with exit 2): each `old` must
    occur exactly once in its file, as `plant` requires."""
    root = Path(__file__).resolve().parents[2]
    stale = []
    for path in sorted((root / "tests" / "planted").glob("*.yaml")):
        for entry in plant_bugs.load(path):
            found = (root / entry["file"]).read_text().count(entry["old"])
            if found != 1:
                stale.append(f"{path.name}: {entry['name']!r} ({entry['file']}: {found} times)")
    assert not stale, "stale planted bugs, update their old text:\n" + "\n".join(stale)
