""""keep only if faster" with its noise margin, quantized_fraction as a gate,
and the FP8 caveat on CPU timing."""
from __future__ import annotations

import pytest

from pipeline.recipe import gates
from pipeline.artifacts import QuantizedArtifact
from pipeline.metrics import speed
from pipeline.recipe.schema import Gate
from pipeline.stages.validate import quantization_metrics


@pytest.mark.parametrize("value, passed", [(1.2, True), (0.95, True), (0.9, True), (0.85, False), (None, False)])
def test_speedup_gate_applies_the_documented_noise_margin(value, passed):
    assert speed.SPEEDUP_MARGIN == 0.10
    [res] = gates.evaluate([Gate(metric="speedup_vs_fp32", min=1.0)], {"speedup_vs_fp32": value})
    assert res.passed is passed
    assert (res.op, res.bound) == (">=", pytest.approx(0.9))
    assert res.message.endswith("(bound >= 0.9)")


def test_the_margin_is_only_for_timing_and_also_reads_engine_metrics():
    [other] = gates.evaluate([Gate(metric="token_agreement", min=1.0)], {"token_agreement": 0.95})
    assert not other.passed and other.bound == 1.0
    [eng] = gates.evaluate([Gate(metric="speedup_vs_fp32", min=1.0)], {"engine.speedup_vs_fp32": 0.92},
                           prefix="engine.")
    assert eng.passed and eng.bound == pytest.approx(0.9)


def test_speedup_gate_fails_like_any_gate_when_slower_beyond_noise():
    """MiniLM INT8 at ORT's basic level: 40.6 ms against 31.4 ms FP32."""
    [res] = gates.evaluate([Gate(metric="speedup_vs_fp32", min=1.0)], {"speedup_vs_fp32": 31.4 / 40.6})
    assert not res.passed and "FAILED: speedup_vs_fp32 = 0.773" in res.message


def test_quantized_fraction_is_a_gate_metric_of_text_generation():
    assert "quantized_fraction" in gates.kind_metrics("text-generation")
    assert gates.problems([Gate(metric="quantized_fraction", min=0.8)], "text-generation", ("validate", "gates")) == []


def test_quantization_metrics_from_the_quantize_artifact():
    q = QuantizedArtifact("m.onnx", "int8", [f"n{i}" for i in range(180)], [f"x{i}" for i in range(30)])
    m = quantization_metrics(q)
    assert m == {"quantized_fraction": pytest.approx(180 / 210), "gemms_high_precision": 30}
    [res] = gates.evaluate([Gate(metric="quantized_fraction", min=0.8)], m)
    assert res.passed and res.value == pytest.approx(0.857142857)
    assert not gates.evaluate([Gate(metric="quantized_fraction", min=0.9)], m)[0].passed
    assert quantization_metrics(QuantizedArtifact("m.onnx", "fp16", [], [])) == {}


def test_fp8_speed_note_says_cpu_numbers_say_nothing_about_gpu_speed():
    note = speed.speed_note("fp8", "basic")
    assert "say nothing about FP8 speed on a GPU" in note and "passes at >= m - 0.1" in note
    assert "GPU speed is measured only through a TensorRT engine" in speed.speed_note("int8", "all")
