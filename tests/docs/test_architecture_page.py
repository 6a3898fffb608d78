"""docs/architecture.md names only paths that exist, and its layer picture is the architecture
test's ``LAYERS`` table: every row's modules and folders exist and sit on that floor, and every
entry of the table is drawn."""
from __future__ import annotations

import re
from pathlib import Path

from test_layers import LAYERS, layer_of

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "pipeline"
#: top-level folders of the repository whose paths the page names
TOPS = ("pipeline", "tests", "docs", "recipes", "benchmarks", "examples", "typings")
_CODE = re.compile(r"`([^`\s]+)`")
_ROW = re.compile(r"^\s?(\d)\s{2}(.+?)\s{2,}(.*)$")
_NAME = re.compile(r"^[\w.]+(?:\.py|/)$")  # errors.py, recipe/, __main__.py


def text_blocks() -> list[list[str]]:
    """The lines of each fenced ``text`` block of the page."""
    out, current = [], None
    for line in PAGE.read_text(encoding="utf-8").split("\n"):
        if current is None and line.strip() == "```text":
            current = []
        elif current is not None and line.startswith("```"):
            out.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return out


def exists(path: str, base: Path = ROOT) -> bool:
    """``path`` (``<kind>``-style placeholders match any one name) exists under ``base``."""
    pattern = re.sub(r"<[^>]+>", "*", path.rstrip("/"))
    return any(base.glob(pattern)) if "*" in pattern else (base / pattern).exists()


def layer_rows() -> dict[int, str]:
    """Layer number -> the row's text, continuation lines joined (the first text block)."""
    rows: dict[int, str] = {}
    last = None
    for line in text_blocks()[0]:
        m = _ROW.match(line)
        if m:
            last = int(m.group(1))
            rows[last] = m.group(3)
        elif line.strip() and last is not None:
            rows[last] += " " + line.strip()
    return rows


def outside_parentheses(text: str) -> str:
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    return text


def test_every_path_in_backticks_exists():
    named = [p for p in _CODE.findall(PAGE.read_text(encoding="utf-8")) if p.split("/")[0] in TOPS and "/" in p]
    assert len(named) > 20  # the page names its homes
    missing = [p for p in named if not exists(p)]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_layer_picture_is_the_layers_table():
    rows = layer_rows()
    assert sorted(rows) == list(range(len(set(LAYERS.values()))))
    drawn: dict[str, int] = {}
    for layer, text in rows.items():
        items = [i.strip() for i in outside_parentheses(text).split(",") if i.strip()]
        assert items and all(_NAME.match(i) for i in items), f"layer {layer}: cannot read {items}"
        for item in items:
            assert (PACKAGE / item).exists(), f"layer {layer}: pipeline/{item} does not exist"
            drawn["pipeline." + item.removesuffix(".py").rstrip("/").replace("/", ".")] = layer
    wrong = {m: (n, layer_of(m)) for m, n in drawn.items() if layer_of(m) != n}
    assert not wrong, f"drawn on another floor than LAYERS gives (drawn, table): {wrong}"
    assert sorted(drawn) == sorted(m for m in LAYERS if m != "pipeline")


def test_every_name_in_the_folder_picture_exists():
    """The second text block: each ``pipeline/`` row's files and folders, and the ``.py`` / ``x/``
    names its description gives, exist in that folder (or below it); each top-level folder exists
    (but the outputs)."""
    block = text_blocks()[1]
    missing, checked = [], 0
    for line in block[1:]:
        if not line.startswith("  ") or line.startswith("   "):
            continue  # a top-level folder of the repository, or a description's continuation
        names, _, description = line.strip().partition("   ")
        folders = [PACKAGE / n for n in names.split() if n.endswith("/")] or [PACKAGE]
        refs = re.findall(r"(?<![\w/.])(\w+(?:/\w+)*(?:\.py|/))(?!\w)", description)
        for name in names.split():
            checked += 1
            if not (PACKAGE / name).exists():
                missing.append(f"pipeline/{name}")
        for ref in refs:
            checked += 1
            if not any(exists(ref, f) or any(f.rglob(ref.rstrip("/"))) for f in folders) and not exists(ref):
                missing.append(f"{names}: {ref}")
    assert checked > 30
    assert not missing, f"docs/architecture.md's folder picture names what does not exist: {missing}"
    top = [line.split()[0] for line in block if line and not line.startswith(" ") and "output:" not in line]
    assert len(top) > 5 and all(exists(t) for t in top), top
