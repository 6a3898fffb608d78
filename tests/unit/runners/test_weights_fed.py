"""Validate runs a Q/DQ graph as the served python-onnxruntime model does: the weights' Q/DQ once
at load (pipeline.runners.weights_fed.WeightsFed), with outputs bit-identical to the graph as written."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from pipeline.runners import base as runners
from pipeline.metrics import speed
from pipeline.models.text_generation.model import prefill_feeds
from pipeline.ort_sessions import ort_session
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from pipeline.runners.weights_fed import WeightsFed
from tiny import seed_export, tiny_recipe


@pytest.fixture(scope="module")
def fp8_graph(tmp_path_factory, tiny_model, tiny_export):
    ws = tmp_path_factory.mktemp("weights-fed")
    path = tiny_recipe(ws, tiny_model)
    seed_export(ws, tiny_export)
    arts = run_pipeline(load_recipe(path), path, quiet=True, only=["quantize"]).artifacts
    return arts["export"], arts["quantize"]


def test_weights_dequantized_once_give_the_graphs_outputs_bit_for_bit(fp8_graph):
    exp, q = fp8_graph
    plain, fed = ort_session(q.ort_path), WeightsFed.load(q.ort_path)
    assert isinstance(fed, WeightsFed) and len(fed.weights) == len(q.quantized_nodes)
    assert [i.name for i in fed.get_inputs()] == [i.name for i in plain.get_inputs()]  # the weights are not asked for
    ids = np.random.default_rng(0).integers(0, 1000, (2, 24), dtype=np.int64)
    feeds = prefill_feeds(exp, ids)
    names = [o.name for o in plain.get_outputs()]
    for a, b in zip(plain.run(names, feeds), fed.run(names, feeds)):
        assert np.array_equal(a, b)
    assert [a.shape for a in fed.run(None, feeds)] == [a.shape for a in plain.run(None, feeds)]


def test_the_speed_line_times_the_graph_as_written_at_its_level(fp8_graph):
    """Triton's ONNX Runtime backend (the default target without an engine) dequantizes at every
    run: the speed line times that, not the faster path validate's accuracy runs take."""
    _, q = fp8_graph
    runner = runners.OrtRunner(q.ort_path)
    assert isinstance(runner.session, WeightsFed)
    assert speed.session_level(runner) == ("basic", ["CPUExecutionProvider"])
    timed = speed.timed_view(runner, runners.SessionView(runner))
    assert isinstance(timed, ort.InferenceSession) and len(timed.get_inputs()) == len(runner.inputs)


def test_a_graph_without_weight_qdq_or_too_large_runs_as_written(fp8_graph, monkeypatch):
    exp, q = fp8_graph
    assert WeightsFed.load(exp.onnx_path) is None  # FP32: level all, no weight Q/DQ
    assert isinstance(runners.OrtRunner(exp.onnx_path).session, ort.InferenceSession)
    with monkeypatch.context() as gpu:
        gpu.setattr("pipeline.runners.weights_fed.providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
        assert WeightsFed.load(q.ort_path) is None  # weights fed at every run would cross to the GPU
    monkeypatch.setattr(WeightsFed, "MEMORY_SHARE", 0.0)  # FP32 weights would not fit
    assert WeightsFed.load(q.ort_path) is None
    assert isinstance(runners.OrtRunner(q.ort_path).session, ort.InferenceSession)
