"""Fuzz the CLI's input handling: random mutations of the shipped recipes
and random ``--set`` values, through ``check`` and the build's pre-flight (the stages
are replaced by a stub, so nothing runs). Never a traceback on the console, never
exit 3; invalid input exits 2, valid input 0, and ``check`` agrees with ``build``."""
from __future__ import annotations

import re
import tempfile
import types
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from pipeline.cli.app import main

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TEXTS = {p.stem: p.read_text() for p in RECIPES}
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(-3, 300), max_size=3), st.lists(st.text(max_size=5), max_size=3),
)
set_text = st.one_of(
    st.text(max_size=16),
    st.sampled_from(["*mlp*", "[*mlp*]", '["*mlp*"]', "[1, 8]", "{min: 1}", "&a x", "*", "[", "{", "!!python/name:os",
                     "1e999", "-1", "null", "[1, *a]", "? x", "a: 1\na: 2", "!!binary AAAA"]),
)


def key_paths(node, prefix=()) -> list[tuple]:
    """Every key path (with list indices) in a parsed recipe."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out += key_paths(v, (*prefix, k))
    return out


def cli(capsys, workdir: Path, argv: list[str]) -> int:
    """Run ``check`` and ``build`` (stages stubbed) on argv; both must agree. Returns the code."""
    stub = types.SimpleNamespace(manifest={"gates": []}, manifest_path=workdir / "manifest.json", passed=True)
    codes = []
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        mp.setattr("pipeline.run.runner.run_pipeline", lambda *a, **k: stub)
        for command in ("check", "build"):
            codes.append(main([command, *argv]))
            out = capsys.readouterr()
            assert "Traceback" not in out.out + out.err, out.err
            assert not (workdir / "pipeline-error.log").exists(), out.err
            if codes[-1] == 2:
                assert out.err.startswith("error: "), out.err
    assert codes[0] == codes[1] and codes[0] in (0, 2), codes
    return codes[0]


def write(workdir: Path, text: str) -> str:
    path = workdir / "recipe.yaml"
    path.write_text(text)
    return str(path)


@FUZZ
@given(name=st.sampled_from(sorted(TEXTS)), data=st.data())
def test_deleted_or_retyped_keys(capsys, name, data):
    recipe = yaml.safe_load(TEXTS[name])
    path = data.draw(st.sampled_from(key_paths(recipe)), label="path")
    parent = recipe
    for k in path[:-1]:
        parent = parent[k]
    if data.draw(st.booleans(), label="delete"):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(scalars, label="value")
    with tempfile.TemporaryDirectory() as tmp:
        code = cli(capsys, Path(tmp), [write(Path(tmp), yaml.safe_dump(recipe))])
    if len(path) == 1 and path[0] in ("model", "export", "quantize", "build", "validate", "triton", "name"):
        assert code == 2  # a required section / name deleted or replaced by a scalar


@FUZZ
@given(name=st.sampled_from(sorted(TEXTS)), data=st.data())
def test_duplicated_key_lines_are_refused(capsys, name, data):
    lines = TEXTS[name].splitlines()
    keyed = [i for i, line in enumerate(lines) if re.match(r"^\s*[A-Za-z_][\w.]*\s*:", line)]
    i = data.draw(st.sampled_from(keyed), label="line")
    text = "\n".join(lines[: i + 1] + [lines[i]] + lines[i + 1:]) + "\n"
    with tempfile.TemporaryDirectory() as tmp:
        assert cli(capsys, Path(tmp), [write(Path(tmp), text)]) == 2
        out = capsys.readouterr()
        assert out.err == ""


@FUZZ
@given(name=st.sampled_from(sorted(TEXTS)), data=st.data(), value=set_text)
def test_random_set_values(capsys, name, data, value):
    recipe = yaml.safe_load(TEXTS[name])
    known = [".".join(str(p) for p in path) for path in key_paths(recipe)]
    key = data.draw(st.one_of(st.sampled_from(known), st.text(min_size=0, max_size=10)), label="key")
    with tempfile.TemporaryDirectory() as tmp:
        cli(capsys, Path(tmp), [str(RECIPES[sorted(TEXTS).index(name)]), f"--set={key}={value}"])


def _rendered_data_args(path: Path, tmp: Path) -> list[str]:
    """The image recipe reads data `make build` renders first: point it at a small rendering."""
    if "image-classification" not in TEXTS[path.stem]:
        return []
    from pipeline.models.image_classification import render

    assert render.main([str(tmp / "lines"), "--calibration-lines", "2", "--eval-lines", "3"]) == 0
    return ["--set", f"quantize.calibration.data.path={tmp / 'lines' / 'calibration'}",
            "--set", f"validate.data.path={tmp / 'lines' / 'eval'}"]


def test_shipped_recipes_pass_the_preflight(capsys):
    with tempfile.TemporaryDirectory() as tmp:
        for path in RECIPES:
            assert cli(capsys, Path(tmp), [str(path), *_rendered_data_args(path, Path(tmp))]) == 0
