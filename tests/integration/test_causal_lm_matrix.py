"""Causal LMs of many families end to end: tiny random models (2 layers, hidden 64, the SmolLM2
tokenizer) built from their transformers configs, through export (check points with a
left-padded row), FP8 and INT8 quantize, validate and triton; two of them (GPT-2's learned
positions, Llama's rotary GQA) served by a real tritonserver."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.trt import backends as engine_backends
from pipeline.models.text_generation.model import KVCacheLM, kv_layout, load_causal_lm
from pipeline.recipe.schema import ModelSource
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from tiny import CAUSAL_LMS, make_tiny_causal_lm, tiny_recipe

ARCHS = sorted(CAUSAL_LMS)
PRECISIONS = ("int8", "fp8")  # one run folder: fp8, the served one, is built last and stays
SERVED = ("gpt2", "llama")  # learned absolute positions; rotary with grouped KV heads
RTX_PROBLEM = engine_backends.import_problem(engine_backends.TENSORRT_RTX)


@pytest.fixture(scope="module")
def tiny_lms(tmp_path_factory):
    """``arch -> model folder``, each built once (on first use) for this module."""
    root, built = tmp_path_factory.mktemp("causal-lms"), {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_tiny_causal_lm(arch, root / arch, root / "tokenizer")
        return built[arch]

    return get


def _wrapped(folder: Path) -> KVCacheLM:
    model, _ = load_causal_lm(ModelSource.model_validate({"kind": "text-generation", "source": {"path": str(folder)}}))
    return KVCacheLM(model, kv_layout(model)).eval()


def _run(lm: KVCacheLM, ids: torch.Tensor, mask: torch.Tensor, past: list[torch.Tensor]):
    with torch.no_grad():
        logits, *rest = lm(ids, mask, *past)
    return rest[-1], rest[:-1]  # last_logits, present


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding_and_a_past_give_the_unpadded_logits(arch, tiny_lms):
    """Row 0 left-padded by 3 positions gives row 1's (the same prompt unpadded) last logits,
    at prefill and at a decode step on the past: the positions follow the mask as in torch."""
    lm = _wrapped(tiny_lms(arch))
    layout = lm.layout
    prompt = torch.tensor([[5, 17, 300, 42]])
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1), torch.cat([prompt, prompt[:, :3]], 1)])
    padded = _run(lm, ids, torch.tensor([[0, 0, 0, 1, 1, 1, 1]] * 1 + [[1] * 7]), [
        torch.zeros(2, layout.kv_heads, 0, layout.head_dim)] * 2 * layout.num_layers)
    alone = _run(lm, prompt, torch.ones(1, 4, dtype=torch.long),
                 [torch.zeros(1, layout.kv_heads, 0, layout.head_dim)] * 2 * layout.num_layers)
    np.testing.assert_allclose(padded[0][0].numpy(), alone[0][0].numpy(), rtol=1e-4, atol=1e-4)
    # One decode step on each row's past: row 0 keeps its 3 masked positions.
    nxt = torch.tensor([[7]])
    step_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    after_pad = _run(lm, nxt, step_mask, [p[:1] for p in padded[1]])
    after_alone = _run(lm, nxt, torch.ones(1, 5, dtype=torch.long), list(alone[1]))
    np.testing.assert_allclose(after_pad[0][0].numpy(), after_alone[0][0].numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", SERVED)
def test_exported_graph_scores_batched_prompts_as_alone(arch, tiny_lms, tmp_path, monkeypatch):
    """On a real export: the generation template (stand-in pb_utils, CPU
    onnxruntime) scores a 20-token prompt cut into other chunks and a prompt prefilled beside a
    left-padded past as it scores each alone (prompt logprobs, greedy tokens, token logprobs)."""
    import onnx

    from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, ResolvedProfile
    from pipeline.models.text_generation.adapter import TextGenerationAdapter
    from pipeline.onnx_io import graph_specs
    from pipeline.stages.triton import write_repository
    from test_repository import load_template, make_recipe, ort_session
    from test_scheduler import batched_and_alone
    from test_serve_generation import fake_backend

    source = ModelSource.model_validate({"kind": "text-generation", "source": {"path": str(tiny_lms(arch))}})
    model, tok = load_causal_lm(source)
    adapter = TextGenerationAdapter(source)
    adapter.layout = layout = kv_layout(model)
    module = KVCacheLM(model, layout).eval()
    recipe, onnx_path, tok_dir = make_recipe(), tmp_path / "model.onnx", tmp_path / "tokenizer"
    adapter.export(module, recipe.export, onnx_path)
    adapter.save_processor(type("Loaded", (), {"processor": tok, "module": module})(), tok_dir)
    inputs, outputs = graph_specs(onnx.load(str(onnx_path), load_external_data=False))
    kv = {"min": [1, layout.kv_heads, 0, layout.head_dim], "opt": [2, layout.kv_heads, 8, layout.head_dim],
          "max": [4, layout.kv_heads, 63, layout.head_dim]}
    shapes = {"input_ids": {"min": [1, 1], "opt": [2, 8], "max": [4, 16]},
              "attention_mask": {"min": [1, 1], "opt": [2, 16], "max": [4, 64]},
              **{n: kv for n in layout.past_names()}}
    write_repository(recipe, export=ExportArtifact(str(onnx_path), inputs, outputs, str(tok_dir)),
                     quantized=QuantizedArtifact(str(onnx_path), "fp32", [], []),
                     build=BuildArtifact("skipped", "not built", None, None, "trtexec.sh",
                                         [ResolvedProfile("default", shapes)]), out_dir=tmp_path / "repo")
    fake_backend(monkeypatch, ort_session(onnx_path))
    served = load_template(tmp_path / "repo" / "tiny_generate")
    batched_and_alone(served, [[(37 * i + 11) % 4000 + 5 for i in range(20)], [4, 2, 3, 5, 7, 9, 10], [6, 1, 8]])


@pytest.fixture(scope="module")
def matrix_builds(tiny_lms, tmp_path_factory):
    """``arch -> {precision: (recipe, RunResult)}``: each architecture built once per precision
    (on first use) in its own workspace; the fp8 run's export is a cache hit of the int8 run's."""
    built: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in built:
            ws, runs = tmp_path_factory.mktemp(f"build-{arch}"), {}
            for precision in PRECISIONS:
                path = tiny_recipe(ws, tiny_lms(arch), **{
                    "quantize.precision": precision, "quantize.per_channel_weights": precision == "int8",
                    "build.backend": "auto",  # a real TensorRT-RTX engine of each family
                    "quantize.exclude.nodes": [], "validate.max_windows": 2,
                    "export.check_points": [{"batch": 1, "sequence": 4, "past_sequence": 0},
                                            {"batch": 3, "sequence": 2, "past_sequence": 5},
                                            {"batch": 2, "sequence": 1, "past_sequence": 3}]})
                recipe = load_recipe(path)
                runs[precision] = (recipe, run_pipeline(recipe, path, quiet=True))
            built[arch] = runs
        return built[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_and_int8_builds_end_to_end(arch, matrix_builds):
    for precision, (recipe, result) in matrix_builds(arch).items():
        man = result.manifest
        assert result.passed and man["verdict"] == "pass", (precision, man["metrics"])
        assert {n: s["status"] for n, s in man["stages"].items()} == dict.fromkeys(
            ("export", "quantize", "build", "validate", "triton"), "ok") | {"build": man["stages"]["build"]["status"]}
        if RTX_PROBLEM is None:  # a real engine of this family, wherever TensorRT-RTX imports
            assert result.artifacts["build"].backend == "tensorrt-rtx", man["stages"]["build"]
            assert man["stages"]["build"]["status"] == "ok", man["stages"]["build"]
        assert np.isfinite(man["metrics"]["relative_perplexity_increase"])
        assert result.artifacts["quantize"].quantized_nodes, precision
    assert (Path(recipe.output_dir) / "smollm2_fp8" / "config.pbtxt").is_file()  # the last (fp8) run's
    checks = result.artifacts["export"].shape_checks
    # the three points given, plus the profile's minimum (batch 1, sequence 1, empty past)
    assert [c["point"] for c in checks][-1] == {"batch": 1, "sequence": 1, "past_sequence": 0, "total_sequence": 1}
    assert all(c["passed"] for c in checks) and "masked_row" in checks[1]


@pytest.mark.server
@pytest.mark.parametrize("arch", SERVED)
def test_served_greedy_tokens_equal_the_validate_stages(arch, matrix_builds, record_property):
    """The fp8 build's repository on a real tritonserver: the streamed greedy tokens of every
    validate prompt equal the validate stage's (compared up to the first EOS)."""
    pytest.importorskip("pytriton")
    from pipeline.serve.check import check_greedy
    from pipeline.serve.run import launch, prepare_for_server

    recipe, result = matrix_builds(arch)["fp8"]
    served = prepare_for_server(recipe, result.artifacts)
    with launch(served) as server:
        checks = check_greedy(served, server.grpc_url)
    verdicts = [f"{arch} prompt {c.index}: {c.verdict}" for c in checks]
    record_property("greedy_checks", verdicts)
    expected = result.artifacts["validate"].greedy_tokens
    assert len(checks) == len(expected["prompt_ids"]) == 2, verdicts
    assert all(c.ok and c.streamed == c.expected and c.streamed for c in checks), "\n".join(verdicts)


def test_a_state_space_model_is_refused_with_exit_2_naming_the_missing_cache():
    from transformers import AutoModelForCausalLM, MambaConfig

    from pipeline.errors import ExportError

    model = AutoModelForCausalLM.from_config(MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=512)).eval()
    with pytest.raises(ExportError, match="MambaForCausalLM.*state-space or recurrent layers have no KV cache") as e:
        kv_layout(model)
    assert e.value.exit_code == 2


def test_a_sliding_window_shorter_than_the_profile_is_refused():
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, Gemma2Config

    from pipeline.errors import ExportError
    from pipeline.models.text_generation.adapter import check_window

    cfg = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    profile = SimpleNamespace(name="default", dims={"total_sequence": SimpleNamespace(max=768)})
    with pytest.raises(ExportError, match=r"total_sequence max 768 exceeds .* \(63 positions of a 64-token window\)") as e:
        check_window(model, [profile])
    assert e.value.exit_code == 2
    check_window(model, [SimpleNamespace(name="short", dims={"total_sequence": SimpleNamespace(max=63)})])
    renamed = SimpleNamespace(name="default", dims={"kv_len": SimpleNamespace(max=768)})  # the recipe's own name
    with pytest.raises(ExportError, match=r"kv_len max 768 exceeds .*; lower kv_len max to <= 63"):
        check_window(model, [renamed], "kv_len")


def test_a_window_below_the_exports_example_past_is_refused_naming_it():
    """A 3-token window keeps 2 past positions, fewer than the export's example past (3): a named
    refusal, not torch.export's constraint violation; a 4-token window is accepted."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, MistralConfig

    from pipeline.errors import ExportError
    from pipeline.models.text_generation.adapter import check_window

    def tiny(window: int):
        cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=window)
        return AutoModelForCausalLM.from_config(cfg).eval()

    profile = SimpleNamespace(name="default", dims={"total_sequence": SimpleNamespace(max=2)})
    with pytest.raises(ExportError, match=r"MistralForCausalLM: a sliding window of 3 tokens keeps 2 past positions; "
                                          r"the export traces with a 3-position past") as e:
        check_window(tiny(3), [profile])
    assert e.value.exit_code == 2
    check_window(tiny(4), [profile])
