"""pipeline plan: the capacity formulas by hand, and against the tiny random Llama's real KV bytes."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.plan import capacity as P
from pipeline.plan import formulas as F
from pipeline.plan import render as R
from pipeline.artifacts import to_jsonable
from pipeline.context import Progress, StageContext
from pipeline.errors import PipelineError
from pipeline.plan.gpus import GPUS
from pipeline.recipe.load import load_recipe
from tiny import make_tiny_llama, tiny_recipe

# --- formulas against hand-computed cases -----------------------------------------------------------

# A tiny GQA layout: 2 layers, 4 query heads sharing 2 KV heads, head_dim 8, FP32.
LAYERS, KV_HEADS, HEAD_DIM, FP32 = 2, 2, 8, 4


def test_kv_per_token_counts_kv_heads_not_query_heads():
    assert F.kv_bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, FP32) == 2 * 2 * 2 * 8 * 4 == 256
    assert F.kv_bytes_per_token(LAYERS, 4, HEAD_DIM, FP32) == 512  # MHA with 4 KV heads: twice the cache
    assert F.kv_bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, 2) == 128  # FP16 cache


def test_kv_at_limit_and_max_concurrent_sequences():
    assert F.kv_bytes_at_limit(256, max_context=10, max_batch=3) == 7680
    # (10_000 - 1_000 - 1_000) / (256 x 10) = 3.125 -> 3 sequences
    assert F.max_concurrent_sequences(10_000, 1_000, 1_000, 2_560) == 3
    assert F.max_concurrent_sequences(1_500, 1_000, 1_000, 2_560) == 0  # weights + workspace do not fit
    with pytest.raises(ValueError, match="kv_per_sequence"):
        F.max_concurrent_sequences(10_000, 0, 0, 0)


def test_decode_roofline_mbu_prefill_and_ridge():
    # 1 GB/s over 1 MB of weights + 256 B x 1000 tokens of KV = 1.256 MB per step -> 796.18 tokens/s
    assert F.decode_roofline(1e9, 1_000_000, 256_000) == pytest.approx(1e9 / 1_256_000)
    assert F.mbu(398.09, 1_000_000, 256_000, 1e9) == pytest.approx(0.5, rel=1e-4)
    # 2 x 250 params x 4 tokens / (1000 B + 256 B x 4) = 2000 / 2024 FLOP/byte
    assert F.prefill_intensity(250, 4, 1_000, 256) == pytest.approx(2000 / 2024)
    assert F.ridge_point(1e12, 1e9) == 1000
    assert F.weight_bytes(135_000_000, 1) == 135_000_000 and F.weight_bytes(10, 4) == 40


def test_replicas_by_littles_law_on_the_roofline():
    # step(b) = (1 MB + b x 1000 B x 20 tokens) / 1 GB/s = 1 ms + 0.02 ms x b; compute time negligible.
    # TPOT SLO 1.09 ms -> b = 4 (1.08 ms); prefill = (1 MB + 10 kB) / 1 GB/s = 1.01 ms;
    # request = 1.01 + 10 x 1.08 = 11.81 ms; 1000 req/s x 11.81 ms = 11.81 in flight / 4 -> 3 replicas.
    kw = dict(prompt=10, output=10, max_batch=8, memory_sequences=100, ttft_s=1.0, weights=1_000_000,
              kv_per_token=1_000, parameters=1_000, bandwidth_bps=1e9, peak_flops=1e15)
    est = F.replicas_for_rate(1000, tpot_s=1.09e-3, **kw)
    assert (est.batch, est.replicas) == (4, 3)
    assert est.step_ms == pytest.approx(1.08) and est.prefill_ms == pytest.approx(1.01)
    assert est.request_s == pytest.approx(0.01181)
    assert est.requests_per_s_per_replica == pytest.approx(4 / 0.01181)
    capped = F.replicas_for_rate(1000, tpot_s=1.09e-3, **{**kw, "max_batch": 2})
    assert (capped.batch, capped.replicas) == (2, math.ceil(1000 * (0.00101 + 10 * 0.00104) / 2))
    slow = F.replicas_for_rate(1000, tpot_s=0.5e-3, **kw)
    assert slow.replicas is None and "slo.tpot_ms" in slow.reason
    no_room = F.replicas_for_rate(1000, tpot_s=1.0, **{**kw, "memory_sequences": 0})
    assert no_room.replicas is None and "memory" in no_room.reason


def _gemm_graph() -> onnx.ModelProto:
    """x[1,4] @ W1[4,3] (quantized) @ W2[3,2] (not); plus an INT64 constant that is no parameter."""
    inits = [numpy_helper.from_array(np.ones((4, 3), np.float32), "w1"),
             numpy_helper.from_array(np.ones((3, 2), np.float32), "w2"),
             numpy_helper.from_array(np.array([1, 2], np.int64), "shape")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="q_proj"),
             helper.make_node("MatMul", ["h", "w2"], ["y"], name="down_proj")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], inits)
    return helper.make_model(graph)


def test_weight_bytes_per_target_from_the_quantized_node_list():
    cpu, gpu, params, quantized = P.weight_bytes_by_target(_gemm_graph(), ["q_proj"], "fp8")
    assert (params, quantized) == (18, 12)
    assert cpu == 18 * 4  # CPU: dequantized at load, FP32 everywhere
    assert gpu == 12 * 1 + 6 * 4  # GPU: FP8 GEMM weight 1 byte, the excluded one FP32
    assert P.weight_bytes_by_target(_gemm_graph(), [], "fp16")[:2] == (36, 36)
    with pytest.raises(PipelineError, match="'o_proj'.*rebuild"):
        P.weight_bytes_by_target(_gemm_graph(), ["o_proj"], "fp8")


def test_gpu_table_is_cited_and_complete():
    names = {g.name for g in GPUS}
    assert {"L4", "L40S", "A100 80GB SXM", "H100 SXM", "H200 SXM"} <= names
    for g in GPUS:
        assert g.source.startswith("NVIDIA") and g.url.startswith("https://www.nvidia.com/")
        assert g.memory_gb > 0 and g.bandwidth_gbs > 0 and g.fp16_tflops > 0
    by_name = {g.name: g for g in GPUS}
    assert by_name["A100 80GB SXM"].fp8_tflops is None  # Ampere: no FP8 Tensor Cores
    assert (by_name["H100 SXM"].bandwidth_gbs, by_name["H200 SXM"].memory_gb) == (3350, 141)


# --- the tiny random Llama, built through its export and quantize stages ----------------------------


@pytest.fixture(scope="module")
def tiny_built(tmp_path_factory):
    """Export and quantize stages of the tiny recipe (what plan reads), their stage.json as the runner writes it."""
    from pipeline.stages import export, quantize

    ws = tmp_path_factory.mktemp("plan")
    path = tiny_recipe(ws, make_tiny_llama(ws / "model"))
    recipe = load_recipe(path)
    run_dir = Path(recipe.work_dir) / recipe.name
    exp = export.run(StageContext(recipe, path, run_dir, "export", Progress(True)))
    q = quantize.run(StageContext(recipe, path, run_dir, "quantize", Progress(True)), exp)
    for stage, art in (("export", exp), ("quantize", q)):
        (run_dir / stage / "stage.json").write_text(json.dumps({"key": "test", "artifact": to_jsonable(art)}))
    return path, recipe


BANDWIDTH = {"median_gbs": 10.0, "runs_gbs": [10.0], "bytes_per_run": 1, "size_mib": 1, "repeats": 1, "method": "fixed"}


def test_kv_formula_matches_present_bytes_of_the_tiny_llama(tiny_built):
    from pipeline.plan.measure import present_kv_bytes

    _, recipe = tiny_built
    facts = P.model_facts(recipe)
    # tests/tiny.py: 2 layers, 2 KV heads (GQA under 4 query heads), head_dim 32 / 4 = 8, FP32
    assert (facts.layers, facts.kv_heads, facts.head_dim, facts.kv_bytes_per_element) == (2, 2, 8, 4)
    per_token = F.kv_bytes_per_token(facts.layers, facts.kv_heads, facts.head_dim, facts.kv_bytes_per_element)
    for batch, sequence, past in ((1, 4, 0), (3, 1, 6), (2, 5, 9)):
        got = present_kv_bytes(facts.export_onnx, batch, sequence, past)
        assert got["bytes"] == per_token * (past + sequence) * batch, (batch, sequence, past)
    check = P.kv_check(facts)
    assert check["match"] and check["bytes"] == 256 * 8 * 2


def test_facts_of_the_tiny_llama(tiny_built):
    _, recipe = tiny_built
    f = P.model_facts(recipe)
    # 12 quantized GEMMs (q, k, v, o, gate, up x 2 layers); down_proj excluded by the recipe
    per_layer = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 32 * 64 + 32 * 64
    assert f.quantized_parameters == 2 * per_layer
    assert f.weight_bytes_cpu == 4 * f.parameters
    assert f.weight_bytes_gpu == f.weight_bytes_cpu - 3 * f.quantized_parameters
    assert (f.max_batch, f.max_context, f.max_prompt_tokens) == (8, 513, 256)  # min(768, 512 + 1)
    assert f.workspace_bytes == recipe.build.workspace_mib * 2**20


def _strict(text: str) -> dict:
    def reject(token):
        raise ValueError(f"non-strict JSON token {token}")
    return json.loads(text, parse_constant=reject)


def test_plan_files_are_strict_and_cite_every_gpu(tiny_built, tmp_path):
    _, recipe = tiny_built
    run_dir = Path(recipe.work_dir) / recipe.name
    (run_dir / "bench").mkdir(exist_ok=True)
    bench = {"llm": {"prompt_tokens": 20, "tpot_by_position": {"tpot_ms": {"16": 2.0, "256": 4.0}}}}
    (run_dir / "bench" / "bench.json").write_text(json.dumps(bench))
    try:
        plan = P.build_plan(recipe, rate=5.0, bandwidth=BANDWIDTH)
    finally:
        (run_dir / "bench" / "bench.json").unlink()
    paths = R.write_plan(plan, tmp_path / "plan")
    data = _strict(paths["json"].read_text())
    assert [r["gpu"]["name"] for r in data["gpus"]] == [g.name for g in GPUS]
    for row in data["gpus"]:
        assert row["gpu"]["source"] and row["gpu"]["url"].startswith("https://")
        assert row["replicas"]["estimate"] is True
        assert row["kv_bytes_at_limit"] == 256 * 513 * 8
    case = data["this_machine"]["measured"][0]
    # bench: TPOT 2 ms at position 16 after a 20-token prompt -> 500 tok/s at context 36
    f = data["model"]
    assert (case["tokens_per_s"], case["context"]) == (500.0, 36)
    assert case["mbu"] == pytest.approx(500 * (f["weight_bytes_cpu"] + 256 * 36) / 10e9)
    assert data["request"] == {"rate_per_s": 5.0, "rate_source": "--rate", "prompt_tokens": 64,
                               "output_tokens": 32, "slo": {"tpot_ms": 300.0, "ttft_ms": 1000.0}}
    md = paths["md"].read_text()
    assert all(f"| {g.name} |" in md for g in GPUS) and "MBU" in md and "KV check" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _args(path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--set", action="append", default=[])
    P.add_plan_arguments(parser)
    return parser.parse_args([str(path), *extra])


def test_cmd_plan_measures_and_writes_under_the_run_dir(tiny_built, capsys):
    path, recipe = tiny_built
    assert P.cmd_plan(_args(path, "--measure", "--rate", "2")) == 0
    out = capsys.readouterr().out
    assert "| H200 SXM |" in out and "plan.json" in out
    data = _strict((Path(recipe.work_dir) / recipe.name / "plan" / "plan.json").read_text())
    measured = data["this_machine"]["measured"]
    assert [m["source"] for m in measured] == ["--measure"] and measured[0]["tokens_per_s"] > 0
    assert 0 < measured[0]["mbu"] and data["this_machine"]["kv_check"]["match"]


def test_unbuilt_recipe_says_to_build_first(tmp_path):
    path = tiny_recipe(tmp_path, tmp_path / "no-model")
    with pytest.raises(PipelineError, match="make build RECIPE=tiny-llm") as e:
        P.cmd_plan(_args(path))
    assert e.value.exit_code == 2


@pytest.mark.parametrize("flag, value", [("--rate", "nan"), ("--rate", "inf"), ("--rate", "-1"),
                                         ("--workspace-gib", "-1"), ("--workspace-gib", "nan"),
                                         ("--workspace-gib", "1e308")])
def test_a_rate_or_workspace_that_is_not_a_finite_positive_number_is_bad_input(tiny_built, flag, value):
    path, _ = tiny_built
    with pytest.raises(PipelineError, match=rf"^{flag}: (must be a finite number > 0, got|.* more bytes)") as e:
        P.cmd_plan(_args(path, flag, value))
    assert e.value.exit_code == 2
