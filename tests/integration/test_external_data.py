"""ONNX files: atomic replacement, external data (> 2 GiB path forced on a tiny
model), load checks and the stage cache."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline import onnx_io
from pipeline.errors import EnvironmentFault, PipelineError
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from pipeline.ort_sessions import ort_session
from tiny import seed_export, tiny_recipe


def _matmul_model(scale: float) -> onnx.ModelProto:
    """y = x @ W with a [64, 32] float32 weight (8 KiB, above the inline threshold)."""
    w = numpy_helper.from_array((np.arange(64 * 32, dtype=np.float32).reshape(64, 32) * scale), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)


@pytest.mark.parametrize("external", [False, True])
def test_saving_over_a_hard_linked_file_leaves_the_other_link_alone(tmp_path, external):
    path = tmp_path / "stage" / "model.onnx"
    onnx_io.save_model_atomic(_matmul_model(1.0), path, external_data=external)
    names = [path.name] + ([onnx_io.data_file_name(path)] if external else [])
    published = tmp_path / "published"
    published.mkdir()
    for name in names:  # what publishing by hard link used to do
        os.link(path.parent / name, published / name)
    before = {n: (published / n).read_bytes() for n in names}
    old_inodes = {n: (path.parent / n).stat().st_ino for n in names}

    onnx_io.save_model_atomic(_matmul_model(2.0), path, external_data=external)

    assert {n: (published / n).read_bytes() for n in names} == before
    for n in names:
        assert (path.parent / n).stat().st_ino != old_inodes[n]
    assert (path.parent / names[-1]).read_bytes() != before[names[-1]]
    x = np.ones((1, 64), np.float32)
    assert ort_session(str(path)).run(None, {"x": x})[0][0, 0] == pytest.approx(2 * sum(range(0, 64 * 32, 32)))
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(names)  # no temp files left


def test_external_data_file_references_its_final_name_and_stale_data_goes(tmp_path):
    path = tmp_path / "model.onnx"
    onnx_io.save_model_atomic(_matmul_model(1.0), path, external_data=True)
    graph = onnx.load(str(path), load_external_data=False)
    assert onnx_io.external_files(graph) == {"model.onnx.data"}
    assert onnx_io.check_loadable(path) is None
    onnx_io.save_model_atomic(_matmul_model(1.0), path, external_data=False)
    assert not (tmp_path / "model.onnx.data").exists()
    assert onnx_io.check_loadable(path) is None


def test_threshold_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(onnx_io.THRESHOLD_ENV, "4096")
    onnx_io.save_model_atomic(_matmul_model(1.0), tmp_path / "big.onnx")  # 8 KiB weight >= 4 KiB
    assert (tmp_path / "big.onnx.data").stat().st_size == 64 * 32 * 4
    monkeypatch.setenv(onnx_io.THRESHOLD_ENV, "100000")
    onnx_io.save_model_atomic(_matmul_model(1.0), tmp_path / "small.onnx")
    assert not (tmp_path / "small.onnx.data").exists()
    monkeypatch.setenv(onnx_io.THRESHOLD_ENV, "2GB")
    with pytest.raises(PipelineError, match=r"PIPELINE_EXTERNAL_DATA_THRESHOLD='2GB'.*number of bytes"):
        onnx_io.external_data_threshold()


def test_check_loadable_names_what_is_wrong(tmp_path):
    path = tmp_path / "model.onnx"
    onnx_io.save_model_atomic(_matmul_model(1.0), path, external_data=True)
    data = tmp_path / "model.onnx.data"
    full = data.read_bytes()
    data.write_bytes(full[:-100])
    assert "tensor 'W' needs bytes up to 8192 of" in onnx_io.check_loadable(path)
    assert "which has only 8092 bytes" in onnx_io.check_loadable(path)
    with pytest.raises(EnvironmentFault, match="quantize: the ONNX file it wrote cannot be loaded"):
        onnx_io.require_loadable(path, "quantize")
    data.write_bytes(full)
    model = onnx.load(str(path), load_external_data=False)
    next(e for e in model.graph.initializer[0].external_data if e.key == "length").value = "4096"
    onnx.save(model, str(path))
    assert ("tensor 'W' declares external data length 4096 bytes but its dtype and shape [64, 32] need 8192"
            in onnx_io.check_loadable(path))
    data.unlink()
    assert "tensor 'W' keeps its weights in 'model.onnx.data', which is missing" in onnx_io.check_loadable(path)
    path.write_bytes(b"\x00not a protobuf")
    assert "does not parse as ONNX" in onnx_io.check_loadable(path)
    assert "no such file" in onnx_io.check_loadable(tmp_path / "absent.onnx")


def test_lazy_model_is_saved_from_its_source_folder(tmp_path):
    src = tmp_path / "src" / "model.onnx"
    onnx_io.save_model_atomic(_matmul_model(3.0), src, external_data=True)
    lazy = onnx.load(str(src), load_external_data=False)
    with pytest.raises(ValueError, match="pass base_dir"):
        onnx_io.save_model_atomic(lazy, tmp_path / "out" / "model.onnx")
    out = onnx_io.save_model_atomic(lazy, tmp_path / "out" / "model.onnx", base_dir=src.parent)
    assert not (out.parent / "model.onnx.data").exists()  # small: inline
    w = numpy_helper.to_array(onnx.load(str(out)).graph.initializer[0])
    np.testing.assert_array_equal(w, numpy_helper.to_array(_matmul_model(3.0).graph.initializer[0]))


# --- the pipeline on the tiny Llama, with external data forced everywhere ---------------


def _run(path: Path, quiet: bool = True):
    return run_pipeline(load_recipe(path), path, quiet=quiet)


def _hits(man: dict) -> dict[str, bool]:
    return {k: bool(v.get("cache_hit")) for k, v in man["stages"].items()}


@pytest.fixture(scope="module")
def inline_run(tmp_path_factory, tiny_model):
    """The same recipe with the default threshold: no external data after export."""
    ws = tmp_path_factory.mktemp("inline")
    return _run(tiny_recipe(ws, tiny_model))


def test_fp8_pipeline_with_external_data_forced(tmp_path, tiny_model, inline_run, monkeypatch):
    monkeypatch.setenv(onnx_io.THRESHOLD_ENV, "0")
    path = tiny_recipe(tmp_path, tiny_model)
    result = _run(path)
    assert result.passed
    q = result.artifacts["quantize"]
    qpath = Path(q.onnx_path)
    assert onnx_io.external_files(onnx.load(str(qpath), load_external_data=False)) == {"model.onnx.data"}
    assert onnx_io.check_loadable(qpath) is None
    assert onnx_io.check_loadable(result.artifacts["export"].onnx_path) is None
    assert not (Path(inline_run.artifacts["quantize"].onnx_path).parent / "model.onnx.data").exists()

    # Calibration and Q/DQ do not depend on where the weights are stored.
    ref = inline_run.artifacts["quantize"]
    assert q.calibration["amax"] == ref.calibration["amax"] and q.quantized_nodes == ref.quantized_nodes
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (2, 9), dtype=np.int64)
    from pipeline.models.text_generation.model import prefill_feeds

    feeds = prefill_feeds(result.artifacts["export"], ids)
    got = ort_session(str(qpath)).run(None, feeds)
    want = ort_session(ref.onnx_path).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)

    # The triton stage copies the graph with its data file; the copy loads.
    repo = Path(result.artifacts["triton"].repository)
    published = next(repo.glob("*/1/model.onnx"))
    assert (published.parent / "model.onnx.data").is_file()
    assert onnx_io.check_loadable(published) is None

    # A truncated data file is not a cache hit: quantize runs again, export stays cached.
    data = qpath.parent / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:-16])
    rerun = _run(path)
    assert _hits(rerun.manifest)["export"] and not _hits(rerun.manifest)["quantize"]
    assert onnx_io.check_loadable(qpath) is None


def test_calibration_shortfall_is_reported(tmp_path, tiny_model, tiny_export, capsys):
    path = tiny_recipe(tmp_path, tiny_model, **{"quantize.calibration.samples": 40,
                                                "quantize.calibration.min_samples": 2,
                                                "quantize.calibration.seq_len": 128,
                                                "quantize.calibration.data.split": {"start": 0, "stop": 6}})
    seed_export(tmp_path, tiny_export)
    result = _run(path, quiet=False)
    cal = result.artifacts["quantize"].calibration
    assert 2 <= cal["samples"] < 40 and cal["samples_requested"] == 40
    expected = f"calibrated on {cal['samples']} of the 40 requested samples"
    assert expected in cal["shortfall"]
    assert expected in capsys.readouterr().err.replace("\n", " ")
    man = json.loads(result.manifest_path.read_text())
    assert expected in man["stages"]["quantize"]["reason"]
    assert expected in (result.manifest_path.parent / "report.md").read_text()


def test_a_data_file_symlinked_from_a_hub_cache_is_readable(tmp_path):
    """A hub cache's snapshot folder links model.onnx.data to ../../blobs/<hash>: the location
    is inside the graph's folder even though the bytes live elsewhere."""
    from pipeline.sources.model import external_data_files

    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    onnx_io.save_model_atomic(_matmul_model(1.0), tmp_path / "model.onnx", external_data=True)
    blobs.mkdir()
    snap.mkdir(parents=True)
    (tmp_path / "model.onnx.data").rename(blobs / "abc123")
    (tmp_path / "model.onnx").rename(snap / "model.onnx")
    (snap / "model.onnx.data").symlink_to(Path("..") / ".." / "blobs" / "abc123")
    assert onnx_io.check_loadable(snap / "model.onnx") is None
    assert external_data_files(snap / "model.onnx") == [snap / "model.onnx.data"]
    model = onnx.load(str(snap / "model.onnx"), load_external_data=False)
    next(e for e in model.graph.initializer[0].external_data if e.key == "location").value = "../x.data"
    onnx.save(model, str(snap / "model.onnx"))
    assert "location '../x.data' outside" in onnx_io.check_loadable(snap / "model.onnx")


@pytest.mark.parametrize("dtype,bits", [("INT4", 4), ("UINT4", 4), ("INT2", 2), ("FLOAT6E2M3", 6)])
def test_packed_types_are_sized_as_onnx_writes_them(tmp_path, dtype, bits):
    if not hasattr(TensorProto, dtype):
        pytest.skip(f"onnx {onnx.__version__} has no {dtype}")
    w = helper.make_tensor("W", getattr(TensorProto, dtype), [1000], b"\x00" * (1000 * bits // 8), raw=True)
    assert onnx_io.tensor_nbytes(w) == 1000 * bits // 8
    graph = helper.make_graph([helper.make_node("Identity", ["W"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", getattr(TensorProto, dtype), [1000])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)], ir_version=11)
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=0)
    assert onnx_io.check_loadable(tmp_path / "m.onnx") is None
