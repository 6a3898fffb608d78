"""The same build in two folders writes the same ONNX bytes, free of machine paths."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from conftest import ROOT
from pipeline import onnx_io
from pipeline.errors import EnvironmentFault
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from tiny import make_tiny_llama, tiny_recipe

STACK = "pkg.torch.onnx.stack_trace"
SCOPES = "pkg.torch.onnx.name_scopes"


def _build(ws: Path, model_src: Path) -> dict[str, bytes]:
    """Build the tiny recipe in ``ws`` (model copied in); the ONNX files and the published
    repository, by path relative to ``ws``."""
    model = ws / "model"
    shutil.copytree(model_src, model)
    path = tiny_recipe(ws, model)
    result = run_pipeline(load_recipe(path, {}), path, quiet=True)
    assert result.passed
    run_dir = ws / "artifacts" / "tiny-llm"
    files = [p for stage in ("export", "quantize") for p in (run_dir / stage).iterdir()
             if p.name.endswith((".onnx", ".onnx.data"))]
    files += [p for p in (ws / "model_repository").rglob("*") if p.is_file()]
    out = {str(p.relative_to(ws)): p.read_bytes() for p in files}
    index = json.loads(out["model_repository/repository.json"])
    for entry in index["models"].values():  # the publish record: this build's recipe (paths included) and time
        assert entry.pop("recipe_hash") and entry.pop("published_at")
    out["model_repository/repository.json"] = json.dumps(index).encode()
    return out


def test_two_folders_build_identical_onnx_without_machine_paths(tmp_path, monkeypatch):
    monkeypatch.setenv(onnx_io.THRESHOLD_ENV, "0")  # quantize writes external data too
    source = make_tiny_llama(tmp_path / "source")
    a, b = tmp_path / "first", tmp_path / "elsewhere" / "second"
    first, second = _build(a, source), _build(b, source)

    names = set(first)
    onnx_files = {n for n in names if n.endswith((".onnx", ".onnx.data"))}
    for stage in ("export", "quantize"):
        assert {f"artifacts/tiny-llm/{stage}/model.onnx", f"artifacts/tiny-llm/{stage}/model.onnx.data"} <= names
    assert any(n.startswith("model_repository/") and n.endswith(".onnx.data") for n in names)
    assert set(second) == names
    assert [n for n in sorted(names) if first[n] != second[n]] == []

    machine = [str(a), str(b), str(ROOT), sys.prefix, str(Path.home())]
    for name in onnx_files:
        leaks = [m for m in machine if m.encode() in first[name] or m.encode() in second[name]]
        assert leaks == [], f"{name} holds {leaks}"

    exported = onnx.load(str(a / "artifacts/tiny-llm/export/model.onnx"), load_external_data=False)
    assert STACK not in {p.key for n in exported.graph.node for p in n.metadata_props}
    scopes = [p.value for n in exported.graph.node for p in n.metadata_props if p.key == SCOPES]
    assert any("down_proj" in v for v in scopes)  # what quantize.exclude matches on is kept
    for rel in ("artifacts/tiny-llm/quantize/model.onnx",
                next(n for n in onnx_files if n.startswith("model_repository/") and n.endswith(".onnx"))):
        written = onnx.load(str(a / rel), load_external_data=False)
        assert STACK not in {p.key for n in written.graph.node for p in n.metadata_props}
        locations = onnx_io.external_files(written)
        assert locations == {"model.onnx.data"}, f"{rel}: external data at {locations}"


def _traced(name: str, **extra) -> onnx.NodeProto:
    node = helper.make_node("Relu", ["x"], ["y"], name=name, doc_string=f'File "/home/me/{name}.py", line 3')
    helper.set_metadata_props(node, {STACK: 'File "/home/me/model.py", line 3', SCOPES: "['model', 'relu']",
                                     **extra})
    return node


def test_strip_removes_stack_traces_everywhere_and_keeps_name_scopes(tmp_path):
    branch = helper.make_graph([_traced("inner")], "branch", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    cond = helper.make_node("If", ["c"], ["z"], name="if", then_branch=branch, else_branch=branch)
    graph = helper.make_graph([_traced("outer", other="kept"), cond], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
                               helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])])
    helper.set_metadata_props(graph.input[0], {STACK: "/home/me"})
    model = helper.make_model(graph)
    helper.set_metadata_props(model, {STACK: "/home/me", "license": "MIT"})
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))

    # outer node: trace + doc; 2 inner nodes (then/else): trace + doc each; the input; the model
    assert onnx_io.strip_file(path) == 2 + 2 * 2 + 1 + 1
    got = onnx.load(str(path))
    outer, inner = got.graph.node[0], got.graph.node[1].attribute[0].g.node[0]
    assert {p.key: p.value for p in outer.metadata_props} == {SCOPES: "['model', 'relu']", "other": "kept"}
    assert [p.key for p in inner.metadata_props] == [SCOPES] and inner.doc_string == outer.doc_string == ""
    assert list(got.graph.input[0].metadata_props) == []
    assert {p.key: p.value for p in got.metadata_props} == {"license": "MIT"}
    before = path.read_bytes()
    assert onnx_io.strip_file(path) == 0 and path.read_bytes() == before  # nothing left: not rewritten


def test_replacing_refuses_a_written_file_that_is_not_onnx_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "model.onnx"
    onnx_io.save_model_atomic(helper.make_model(helper.make_graph([_traced("n")], "g", [], [])), path)
    before = path.read_bytes()
    with pytest.raises(EnvironmentFault, match=r"model\.onnx: the writer produced a file that does not parse as ONNX"):
        with onnx_io.replacing(path) as tmp:
            tmp.write_bytes(b"\x00not a protobuf")
    assert path.read_bytes() == before and STACK.encode() not in before  # save_model_atomic stripped it too
