"""An ``onnx:`` model source that is broken is bad input (exit 2), named, never an internal
error: a truncated external data file, a graph ONNX Runtime cannot load, and an input dim
that is fixed in the graph (advice for the graph, not for a torch example)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from conftest import ROOT
from pipeline.cli import app as cli
from pipeline.errors import ExportError
from pipeline.sources.model import ModelFileError, external_data_files

EXAMPLE = ROOT / "examples" / "custom-model"
EMBED_BYTES = 256 * 64 * 4  # float32 [256, 64] embedding, kept in model.onnx.data


def byte_graph(batch: int | str = "batch", op: str = "ReduceMean") -> onnx.ModelProto:
    """byte_ids, attention_mask int64 [batch, length] -> logits [batch, 4], features [batch, 64]:
    Gather of a [256, 64] embedding, mean over length, a [64, 4] head."""
    rng = np.random.default_rng(0)
    embed = numpy_helper.from_array(rng.standard_normal((256, 64)).astype(np.float32), "embed.weight")
    head = numpy_helper.from_array(rng.standard_normal((64, 4)).astype(np.float32), "head.weight")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [helper.make_node("Gather", ["embed.weight", "byte_ids"], ["emb"], name="embed"),
             helper.make_node(op, ["emb", "axes"], ["features"], name="pool", keepdims=0),
             helper.make_node("MatMul", ["features", "head.weight"], ["logits"], name="head")]
    ins = [helper.make_tensor_value_info(n, TensorProto.INT64, [batch, "length"]) for n in ("byte_ids", "attention_mask")]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 4]),
            helper.make_tensor_value_info("features", TensorProto.FLOAT, [batch, 64])]
    graph = helper.make_graph(nodes, "bytes", ins, outs, [embed, head, axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)  # ORT 1.x reads <= 10


def onnx_workspace(tmp_path: Path, model: onnx.ModelProto) -> Path:
    """The custom-model example with ``source: {onnx: ./model.onnx}`` (external data), writing into tmp_path."""
    ws = tmp_path / "ws"
    shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns("__pycache__"))
    onnx.save_model(model, str(ws / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
                    size_threshold=1024)
    data = yaml.safe_load((ws / "recipe.yaml").read_text())
    data["name"], data["model"]["source"] = "onnx-source", {"onnx": "./model.onnx"}
    data["work_dir"], data["output_dir"] = str(tmp_path / "artifacts"), str(tmp_path / "model_repository")
    (ws / "recipe.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return ws / "recipe.yaml"


def build(path: Path, capsys) -> tuple[int, str]:
    code = cli.main(["build", str(path), "--quiet"])
    return code, capsys.readouterr().err


def test_external_data_files_lists_intact_data_and_refuses_a_truncated_file(tmp_path):
    path = onnx_workspace(tmp_path, byte_graph())
    graph, data = path.parent / "model.onnx", path.parent / "model.onnx.data"
    assert external_data_files(graph) == [data] and data.stat().st_size >= EMBED_BYTES + 64 * 4 * 4  # + head
    with open(data, "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(ModelFileError) as err:
        external_data_files(graph)
    msg = str(err.value)
    assert "'embed.weight'" in msg and str(data) in msg and f"up to {EMBED_BYTES}" in msg and "only 1000 bytes" in msg


def test_truncated_external_data_exits_2_naming_tensor_and_file(tmp_path, capsys):
    path = onnx_workspace(tmp_path, byte_graph())
    with open(path.parent / "model.onnx.data", "r+b") as fh:
        fh.truncate(1000)
    code, err = build(path, capsys)
    assert code == 2, err
    assert "'embed.weight'" in err and "model.onnx.data" in err and "only 1000 bytes" in err
    assert "internal error" not in err and not (tmp_path / "artifacts" / "onnx-source" / "error.log").exists()


def test_graph_onnx_runtime_cannot_load_exits_2_naming_the_file(tmp_path, capsys):
    path = onnx_workspace(tmp_path, byte_graph(op="NoSuchReduce"))  # parses as ONNX, no such ORT kernel
    code, err = build(path, capsys)
    assert code == 2, err
    assert "ONNX Runtime cannot load model.source.onnx" in err and str(path.parent / "model.onnx") in err
    assert "NoSuchReduce" in err and "internal error" not in err


def test_an_empty_onnx_file_is_named_as_such(tmp_path, capsys):
    path = onnx_workspace(tmp_path, byte_graph())
    (path.parent / "model.onnx").write_bytes(b"")  # protobuf parses 0 bytes as an empty model
    code, err = build(path, capsys)
    assert code == 2, err
    assert f"model.source.onnx: {path.parent / 'model.onnx'} holds no ONNX graph (0 bytes)" in err


def test_adapter_source_session_failure_is_an_export_error(tmp_path):
    from pipeline.models.generic.adapter import _source_session

    path = onnx_workspace(tmp_path, byte_graph(op="NoSuchReduce"))
    with pytest.raises(ExportError, match=r"ONNX Runtime cannot load model.source.onnx .*model.onnx: .*NoSuchReduce"):
        _source_session(path.parent / "model.onnx")


def test_fixed_batch_in_an_onnx_source_says_make_the_graph_dim_symbolic(tmp_path, capsys):
    path = onnx_workspace(tmp_path, byte_graph(batch=1))
    code, err = build(path, capsys)
    assert code == 2, err
    assert "the graph's input 'byte_ids' has the fixed dim 1 at axis 0" in err
    assert "onnx.tools.update_model_dims.update_inputs_outputs_dims(model, {'byte_ids': ['batch', 'length']}" in err
    assert "re-export the model with dynamic axes" in err
    assert "give an example" not in err and "size it from the tensor" not in err  # torch-export advice


def test_fixed_batch_advice_for_a_torch_export_is_unchanged():
    from pipeline.checks import export as ec

    model = byte_graph(batch=3)
    with pytest.raises(ExportError) as err:
        ec.check_symbolic(model, {"byte_ids": {0: "batch"}})
    assert "baked in as the constant 3" in str(err.value) and "give an example with batch >= 2" in str(err.value)
    with pytest.raises(ExportError) as err:
        ec.check_symbolic(model, {"byte_ids": {0: "batch"}}, source="m.onnx")
    assert "model.source.onnx m.onnx: the graph's input 'byte_ids' has the fixed dim 3 at axis 0" in str(err.value)
