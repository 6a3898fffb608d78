"""The shell commands in the README and docs/ that a user would copy.

Every fenced ``sh`` / ``console`` / ``bash`` block, and every untagged block that looks like a
command, carries one tag (docs/README.md): ``runnable`` blocks are run here, line by line, from
the repository root; ``e2e``, ``gpu`` and ``external`` ones are covered elsewhere or need a GPU
or outside services; ``bench`` ones are benchmarks (they print speed and memory, nothing to assert).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TAGS = {"runnable", "e2e", "gpu", "external", "bench"}
SHELLS = {"sh", "console", "bash", "shell"}
_FENCE = re.compile(r"^```(\S*)\s*(.*)$")
_EXIT = re.compile(r"#\s*exit\s+(\d+)\s*$")


def blocks(path: Path) -> list[tuple[int, str, str, list[str]]]:
    """(line number, language, tag, lines) of each fenced block in ``path``."""
    out, current = [], None
    for no, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        m = _FENCE.match(line)
        if m and current is None:
            current = (no, m.group(1), m.group(2).strip(), [])
        elif line.startswith("```") and current is not None:
            out.append(current)
            current = None
        elif current is not None:
            current[3].append(line)
    return out


def commands(lines: list[str]) -> list[tuple[str, int]]:
    """Each command of a block (``\\`` continuations joined) with its expected exit status."""
    joined = "\n".join(lines).replace("\\\n", " ")
    out = []
    for cmd in joined.split("\n"):
        if cmd.strip() and not cmd.lstrip().startswith("#"):
            m = _EXIT.search(cmd)
            out.append((cmd, int(m.group(1)) if m else 0))
    return out


ALL = [(p, *b) for p in PAGES for b in blocks(p)]
SHELL_BLOCKS = [b for b in ALL if b[2] in SHELLS or (b[2] == "" and b[4][:1] and
                                                       re.match(r"\s*(make|\.venv/|python|kubectl|curl)", b[4][0]))]
RUNNABLE = [(p, no, cmd, code) for p, no, _, tag, lines in SHELL_BLOCKS if tag == "runnable"
            for cmd, code in commands(lines)]


@pytest.mark.parametrize("page,line,lang,tag,lines", SHELL_BLOCKS,
                         ids=[f"{b[0].relative_to(ROOT)}:{b[1]}" for b in SHELL_BLOCKS])
def test_every_command_block_is_tagged(page, line, lang, tag, lines):
    assert lang in SHELLS and tag in TAGS, (
        f"{page.relative_to(ROOT)}:{line}: tag this block ```sh <tag>, <tag> one of {sorted(TAGS)}")


def test_there_are_runnable_commands():
    assert len(RUNNABLE) >= 8


@pytest.mark.parametrize("page,line,cmd,code", RUNNABLE,
                         ids=[f"{r[0].relative_to(ROOT)}:{r[1]}:{r[2][:60]}" for r in RUNNABLE])
def test_runnable_command(page, line, cmd, code):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    run = re.sub(r"^\s*(\.venv/bin/)?python(3)?\b", lambda _: sys.executable, cmd)
    proc = subprocess.run(run, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, (f"{page.relative_to(ROOT)}:{line}: `{cmd}` exited {proc.returncode}, "
                                     f"expected {code}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def test_readme_is_at_most_12_kb():
    size = (ROOT / "README.md").stat().st_size
    assert size <= 12 * 1024, f"README.md is {size} bytes; move detail to a docs/ page"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    prose = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)  # not in code blocks
    missing = []
    for target in _LINK.findall(prose):
        path = target.split("#")[0]
        if path and "://" not in path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)}: links to missing files {missing}"
