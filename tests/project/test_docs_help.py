"""A script's module docstring is its `--help` description (argparse's `description=__doc__`):
the example commands in it must print as they are written. A `\\` at a line's end inside a plain
\"\"\"...\"\"\" is Python's line continuation, so `python x.py --a \\` + newline + `--b` printed as
one line with a run of spaces in it; in the docstring it is spelled `\\\\`."""

import ast

import pytest
from run_helpers import ROOT

SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_help_text_keeps_every_line_of_the_docstring(script):
    source = script.read_text(encoding="utf-8")
    module = ast.parse(source)
    if not ast.get_docstring(module, clean=False):
        pytest.skip("no module docstring")
    node = module.body[0].value
    literal = ast.get_source_segment(source, node)
    printed = node.value
    assert literal.count("\n") == printed.count("\n"), (
        f"{script.name}: a line of the docstring ends in a bare backslash (write \\\\)"
    )
