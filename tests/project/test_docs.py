"""The README and the pages under docs/: every relative link lands, and the README stays a guide.

A link is `[text](target)` outside code; a relative target must name a file of the repository,
and a `#fragment` must be a heading of that page, spelled as GitHub makes heading anchors
(lowercase, punctuation other than `-` and `_` dropped, each space a `-`, a repeated heading
suffixed `-1`, `-2`, ...: github/cmark-gfm's anchor rule, as github.com renders it).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages other work adds; until they exist a link to them is expected, not broken.
PAGES_TO_COME = {"performance.md", "gpu.md", "tiny-configs.md", "errors.md", "lora-rules.md"}
FILES_TO_COME = PAGES_TO_COME
README_MAX_LINES = 350

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def outside_fences(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before duplicates are numbered)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and "_" (any script)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in outside_fences(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of the page's links that are not URLs, in order (code is not prose)."""
    links = []
    for line in outside_fences(page.read_text(encoding="utf-8")):
        in_code = re.sub(r"(`+)(?:(?!\1).)*\1", lambda m: "`" * len(m.group(0)), line)
        for match in LINK.finditer(line):
            if in_code[match.start()] == "`":  # the link starts inside a code span
                continue
            target = match.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
                links.append(target)
    return links


def test_the_anchor_rule_on_known_github_anchors():
    # Anchors github.com gives these headings (README of this project before its rewrite).
    assert github_slug("Runs and data on object storage (s3://, gs://)") == (
        "runs-and-data-on-object-storage-s3-gs"
    )
    assert github_slug("Image quality: FID, KID, CLIP score") == "image-quality-fid-kid-clip-score"
    assert github_slug("LoRA, LoCon and DoRA") == "lora-locon-and-dora"
    assert (
        github_slug("`model` (`ldm.diffusion.LatentDiffusion`)")
        == "model-ldmdiffusionlatentdiffusion"
    )
    assert github_slug("Plan A - this config alone") == "plan-a---this-config-alone"


def test_duplicate_headings_are_numbered(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Setup\n\n```\n# not a heading\n```\n## Setup\n### Setup\n", encoding="utf-8")
    assert anchors(page) == {"setup", "setup-1", "setup-2"}


def test_links_inside_code_are_not_links(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "[a](a.md) `[b](b.md)` and [c](https://x.org)\n```\n[d](d.md)\n```\n[e](#e)\n",
        encoding="utf-8",
    )
    assert relative_links(page) == ["a.md", "#e"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands(page):
    broken, to_come = [], []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            if file.name in PAGES_TO_COME and file.parent == ROOT / "docs":
                to_come.append(target)
            else:
                broken.append(f"{target}: no file {file.relative_to(ROOT)}")
            continue
        if fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
    if to_come:
        pytest.skip(f"pages not written yet: {sorted(set(to_come))}")


def test_the_readme_is_a_guide_of_at_most_350_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_every_docs_page_is_reachable_from_the_readme():
    """A page nobody links to is a page nobody reads: each is linked from README or a page."""
    linked = set()
    for page in PAGES:
        for target in relative_links(page):
            path = target.partition("#")[0]
            if path:
                linked.add((page.parent / path).resolve())
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages linked from nowhere: {orphans}"


# --- what the pages name: files of the repository, and the flags of the commands they show ---

REPO_PATH = re.compile(
    r"(?<![\w/.<-])((?:configs|scripts|ldm|lun|tests|docker|docs)/[\w./-]*\w|requirements[\w-]*\.txt)"
)
COMMAND = re.compile(r"(?<![\w/])(main\.py|scripts/\w+\.py)\b")
FLAG = re.compile(r"(?<![\w-])(--[a-zA-Z][\w-]*)")
IMPORT = re.compile(r"^\s*from ((?:lun|ldm)(?:\.\w+)*) import", re.M)
SCRIPT_IMPORT = re.compile(r"^from (\w+) import", re.M)  # a sibling at the top: bench_common


def code_text(page: Path) -> list[str]:
    """Lines of fenced code and the contents of inline code spans: where commands and paths are."""
    text = page.read_text(encoding="utf-8")
    spans, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif fenced:
            spans.append(line)
        else:
            spans += re.findall(r"`([^`]+)`", line)
    return spans


def flag_literals(script: Path) -> set[str]:
    """The `--flag` string literals of a script and of the lun/ldm modules and the sibling
    script modules it imports from: a flag a page shows must be spelled there (argparse takes no
    flag that is not)."""
    sources, flags = [script], set()
    text = script.read_text(encoding="utf-8")
    for module in IMPORT.findall(text):
        path = ROOT / (module.replace(".", "/") + ".py")
        sources.append(path if path.exists() else ROOT / module.replace(".", "/") / "__init__.py")
    for module in SCRIPT_IMPORT.findall(text):
        sources += [script.parent / f"{module}.py", script.parent / module / "__init__.py"]
    for source in sources:
        if source.exists():
            flags |= set(re.findall(r"""["'](--[a-zA-Z][\w-]*)["']""", source.read_text("utf-8")))
    return flags


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_page_names_exists(page):
    missing = set()
    for span in code_text(page):
        for path in REPO_PATH.findall(span):
            if "*" in path or "<" in path:
                continue
            if not (ROOT / path).exists() and not (ROOT / path.rstrip("/")).exists():
                missing.add(path)
    missing = {p for p in missing if Path(p).name not in FILES_TO_COME}
    assert not missing, f"{page.relative_to(ROOT)} names no such file: {sorted(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_of_a_documented_command_is_spelled_in_its_script(page):
    # A command runs on over "\" line ends; its flags are checked against the script it calls.
    text = "\n".join(code_text(page)).replace("\\\n", " ")
    unknown = []
    for line in text.splitlines():
        commands = list(COMMAND.finditer(line))
        for i, command in enumerate(commands):
            end = commands[i + 1].start() if i + 1 < len(commands) else len(line)
            script = ROOT / command.group(1)
            if not script.exists():
                continue  # test_every_repository_path_a_page_names_exists says so
            known = flag_literals(script)
            words = line[command.end() : end].split("#")[0]
            for flag in FLAG.findall(words):
                # argparse.BooleanOptionalAction makes --no-X of --X
                if flag not in known and flag.replace("--no-", "--", 1) not in known:
                    unknown.append(f"{command.group(1)} {flag}")
    assert not unknown, f"{page.relative_to(ROOT)}: flags no parser has: {sorted(set(unknown))}"
