"""A native crash inside the engine builder is a named error, not a silent death.

Each TensorRT(-RTX) parse + build runs in a child process (a fork of a fork server), so a SIGFPE
there kills the child only. The child crashes for real: ``PIPELINE_FAULT=builder:build`` with
``PIPELINE_FAULT_SIGNAL`` makes it send itself the signal (pipeline.faults); and a tiny random
OLMo-2 (q/k RMSNorm before RoPE) crashes TensorRT-RTX 1.7.1's ``build_serialized_network``
with SIGFPE on its own, its FP8 graph as its INT8 one.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import onnx
import pytest

from pipeline.trt import backends as engine_backends
from pipeline.trt import bisect as engine_bisect
from pipeline.trt import builder as engine_builder
from pipeline.errors import EXIT_ENVIRONMENT, EXIT_INTERNAL
from pipeline.stages import build
from conftest import ROOT
from rtx_graphs import QDQ_INPUTS, write_qdq_matmuls
from test_builder_rtx import DECODE, PREFILL, rtx_recipe

pytestmark = pytest.mark.skipif(engine_backends.import_problem(engine_backends.TENSORRT_RTX) is not None,
                                reason="tensorrt-rtx-cu12-bindings/-libs not installed (core dependencies)")


def _crash_at(monkeypatch, point: str, sig: str, only_if: str | None = None) -> None:
    monkeypatch.setenv("PIPELINE_FAULT", point)
    monkeypatch.setenv("PIPELINE_FAULT_SIGNAL", sig)
    if only_if:
        monkeypatch.setenv("PIPELINE_FAULT_IF", only_if)


def test_a_signal_in_the_builder_is_exit_3_naming_step_signal_target_and_graph(tmp_path, monkeypatch):
    onnx_path = write_qdq_matmuls(tmp_path / "q.onnx")
    _crash_at(monkeypatch, "builder:build", "SIGFPE")
    with pytest.raises(engine_builder.BuilderCrash) as err:
        build.build_from_onnx(rtx_recipe(tmp_path, [PREFILL, DECODE]), onnx_path, QDQ_INPUTS, tmp_path / "build")
    e = err.value
    assert e.exit_code == EXIT_INTERNAL and (e.signal_name, e.step) == ("SIGFPE", "build")
    msg = str(e)
    assert msg.startswith(f"build: TensorRT-RTX {engine_backends.TENSORRT_RTX.version()} crashed with SIGFPE "
                          f"(floating-point exception) in build_serialized_network for sm89 on {Path(onnx_path).resolve()}")
    assert "earlier stages stay cached" in msg and "profile 'decode': x min [1, 1, 16]" in msg
    assert "build --bisect-crash" in msg and "build.backend: none" in msg and "quantize.exclude.nodes" in msg
    assert not list((tmp_path / "build").glob("*.engine"))


def test_a_crash_while_parsing_names_the_parser(tmp_path, monkeypatch):
    _crash_at(monkeypatch, "builder:parse", "SIGSEGV")
    with pytest.raises(engine_builder.BuilderCrash, match=r"crashed with SIGSEGV \(segmentation fault\) in "
                                                          r"OnnxParser.parse_from_file for sm89"):
        build.build_from_onnx(rtx_recipe(tmp_path, [PREFILL]), write_qdq_matmuls(tmp_path / "q.onnx"), QDQ_INPUTS,
                              tmp_path / "build")


def test_a_sigkilled_builder_is_out_of_memory_exit_4(tmp_path, monkeypatch):
    _crash_at(monkeypatch, "builder:build", "SIGKILL")
    with pytest.raises(engine_builder.MemoryFault, match=r"builder process was killed with SIGKILL in "
                                                         r"build_serialized_network .* OOM killer") as err:
        build.build_from_onnx(rtx_recipe(tmp_path, [PREFILL]), write_qdq_matmuls(tmp_path / "q.onnx"), QDQ_INPUTS,
                              tmp_path / "build")
    assert err.value.exit_code == EXIT_ENVIRONMENT


def test_the_child_builds_the_bytes_an_in_process_build_does(tmp_path, monkeypatch):
    onnx_path = write_qdq_matmuls(tmp_path / "q.onnx")
    recipe = rtx_recipe(tmp_path, [PREFILL, DECODE])

    def engine_sha(folder: str) -> str:
        art = build.build_from_onnx(recipe, onnx_path, QDQ_INPUTS, tmp_path / folder, quantized_nodes=["mm1", "mm2"])
        assert art.status == "ok" and art.reason == "", art.reason  # the network summary came back too
        return hashlib.sha256(Path(art.engine_path).read_bytes()).hexdigest()

    isolated = engine_sha("child")
    monkeypatch.setattr(engine_builder, "ISOLATED", False)
    assert engine_sha("here") == isolated


def test_a_parser_refusal_in_the_child_keeps_its_error_and_exit_code(tmp_path):
    from rtx_graphs import write_unbuildable

    from pipeline.artifacts import TensorSpec
    from test_builder_rtx import BATCH

    with pytest.raises(engine_builder.EngineBuildError, match=r"node 'to_string' \(Cast\)") as err:
        build.build_from_onnx(rtx_recipe(tmp_path, [BATCH]), write_unbuildable(tmp_path / "bad.onnx"),
                              [TensorSpec("x", "float32", ["batch", 16])], tmp_path / "build")
    assert err.value.exit_code == 2 and not isinstance(err.value, engine_builder.BuilderCrash)


def test_bisect_reduces_the_graph_to_the_crashing_node(tmp_path, monkeypatch):
    """The builder crashes only where the network holds a layer named after node mm2: the bisect
    keeps mm2 alone, its dequantized operands cut into fixed-shape graph inputs, and names mm2
    as the GEMM to exclude."""
    onnx_path = write_qdq_matmuls(tmp_path / "q.onnx")
    _crash_at(monkeypatch, "builder:build", "SIGFPE", only_if="mm2")
    with pytest.raises(engine_builder.BuilderCrash) as err:
        build.build_from_onnx(rtx_recipe(tmp_path, [PREFILL, DECODE]), onnx_path, QDQ_INPUTS, tmp_path / "build",
                              quantized_nodes=["mm1", "mm2"], bisect_crash_s=120)
    crash = tmp_path / "build" / build.CRASH_DIR
    sub = onnx.load(str(crash / engine_bisect.SUBGRAPH))
    nodes = [n.name for n in sub.graph.node]
    assert nodes == ["mm2"]
    assert [(i.name, [d.dim_value for d in i.type.tensor_type.shape.dim]) for i in sub.graph.input] == [
        ("r_dq", [2, 16, 8]), ("w2_dq", [8, 4])]  # profile 'prefill' opt: x [2, 16, 16]
    msg = str(err.value)
    assert f"the smallest subgraph that still crashes has {len(nodes)} of 11 nodes, saved to {crash / engine_bisect.SUBGRAPH}" in msg
    assert "quantize.exclude.nodes: [mm2]" in msg and "fixed shapes: profile 'prefill' opt" in msg
    assert "| `mm2` | MatMul |" in (crash / engine_bisect.REPORT).read_text()
    assert not [p.name for p in crash.iterdir() if ".tmp-" in p.name]  # no candidate left behind


def test_bisect_stops_at_its_time_limit_with_what_it_has(tmp_path, monkeypatch):
    onnx_path = write_qdq_matmuls(tmp_path / "q.onnx")
    _crash_at(monkeypatch, "builder:build", "SIGFPE")
    with pytest.raises(engine_builder.BuilderCrash, match=r"bisect \(0 builds in 0 s, stopped by the time limit.*\): "
                                                          r"no candidate crashed within the time limit"):
        build.build_from_onnx(rtx_recipe(tmp_path, [PREFILL]), onnx_path, QDQ_INPUTS, tmp_path / "build",
                              bisect_crash_s=0)


def test_the_cli_exits_3_keeps_the_earlier_stages_and_bisects_on_request(tmp_path, tiny_model, tiny_export,
                                                                         monkeypatch, capsys):
    """``build --bisect-crash`` on the tiny Llama whose builder dies of SIGFPE wherever the network
    holds its first q_proj GEMM: exit 3, the whole message on the console, the build recorded as
    failed after export and quantize, which the next run takes from the cache."""
    from pipeline.cli import app as cli
    from tiny import seed_export, tiny_recipe

    path = tiny_recipe(tmp_path, tiny_model, **{"build.backend": "auto"})
    seed_export(tmp_path, tiny_export)
    _crash_at(monkeypatch, "builder:build", "SIGFPE", only_if="node_linear")
    capsys.readouterr()
    code = cli.main(["build", str(path), "--quiet", "--bisect-crash", "--bisect-time-limit", "120"])
    err = capsys.readouterr().err
    assert code == EXIT_INTERNAL, err
    run_dir = tmp_path / "artifacts" / "tiny-llm"
    assert err.startswith("internal error: BuilderCrash: build: TensorRT-RTX") and "crashed with SIGFPE" in err
    assert "  - build.backend: none: no engine" in err  # the lines after the first
    assert "quantize.exclude.nodes: [model.model.layers.*.self_attn.q_proj" in err, err
    assert (run_dir / "build" / "crash" / engine_bisect.SUBGRAPH).is_file() and (run_dir / "error.log").is_file()
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert [stages[s]["status"] for s in ("export", "quantize", "build")] == ["ok", "ok", "failed"]
    monkeypatch.delenv("PIPELINE_FAULT")
    capsys.readouterr()
    assert cli.main(["build", str(path)]) == 0
    assert "quantize: cached (ok)" in capsys.readouterr().err
    assert not (run_dir / "build" / "crash").exists()  # a bisect's files go with the next build


# --- the real crash: a tiny OLMo-2 through the CLI -------------------------------------------


@pytest.mark.e2e  # ~40-70 s on 2 shared cores: a real export, then the crash and its bisect through the CLI
def test_tiny_olmo2_crash_is_exit_3_keeps_export_and_quantize_and_bisects(tmp_path):
    """TensorRT-RTX 1.7.1 dies of SIGFPE building the tiny OLMo-2's FP8 graph (q/k RMSNorm after
    the q/k/v GEMMs that share one quantized input). ``build --bisect-crash`` exits 3 naming the
    signal, the step, the target and the graph; export and quantize are recorded (and cached); the
    bisect names the GEMMs by module scope, in every layer. (Excluding ``*self_attn.q_proj`` from
    quantization then builds, validates and publishes: checked by hand, 50 s more.)"""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import crash
    from tiny import smollm2_tokenizer, tiny_recipe

    tok = smollm2_tokenizer(tmp_path / "tokenizer")
    cfg = transformers.Olmo2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    path = tiny_recipe(tmp_path, tmp_path / "model", **{"build.backend": "auto", "quantize.exclude.nodes": [],
                                                        "validate.generation": None, "validate.max_windows": 1})
    run_dir = tmp_path / "artifacts" / "tiny-llm"
    out = crash.run_build(["build", str(path), "--bisect-crash", "--bisect-time-limit", "120"], {}, ROOT, tmp_path / "build.log")
    assert out.returncode == EXIT_INTERNAL, out.stderr[-3000:]
    assert (f"internal error: BuilderCrash: build: TensorRT-RTX {engine_backends.TENSORRT_RTX.version()} crashed with "
            f"SIGFPE (floating-point exception) in build_serialized_network for sm89 on {run_dir / 'quantize' / 'model.onnx'}"
            ) in out.stderr
    assert "traceback in" in out.stderr and (run_dir / "error.log").is_file()
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert (stages["export"]["status"], stages["quantize"]["status"], stages["build"]["status"]) == ("ok", "ok", "failed")
    assert stages["build"]["reason"].startswith("BuilderCrash: build: TensorRT-RTX")
    scopes = "model.model.layers.*.self_attn.q_proj, model.model.layers.*.self_attn.k_proj"
    assert f"quantize.exclude.nodes: [{scopes}" in out.stderr, out.stderr[-3000:]
    assert (run_dir / "build" / "crash" / engine_bisect.SUBGRAPH).is_file()
