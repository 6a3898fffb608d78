"""Several optimization profiles (decode: sequence 1; prefill) reach Triton
(``instance_group.profile``), and max_batch_size / context limits account for every one."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.artifacts import BuildArtifact, ResolvedProfile
from pipeline.errors import RecipeError, TritonConfigError
from pipeline.recipe.load import load_recipe
from pipeline.triton.config import check_config, compute_config, parse_config
from pipeline.stages.triton import write_repository
from pipeline.triton.repository import context_limits, profile_batch
from test_repository import HEAD_DIM, HEADS, make_recipe, stage  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[3]


def _profile(name: str, batch: tuple[int, int, int], seq: tuple[int, int, int], past: tuple[int, int, int]):
    shapes = {"input_ids": {k: [b, s] for k, b, s in zip(("min", "opt", "max"), batch, seq)},
              "attention_mask": {k: [b, s + p] for k, b, s, p in zip(("min", "opt", "max"), batch, seq, past)}}
    for i in range(2):
        for kv in ("key", "value"):
            shapes[f"past_key_values.{i}.{kv}"] = {k: [b, HEADS, p, HEAD_DIM]
                                                    for k, b, p in zip(("min", "opt", "max"), batch, past)}
    return ResolvedProfile(name, shapes)


DECODE = _profile("decode", (1, 4, 8), (1, 1, 1), (1, 128, 511))
PREFILL = _profile("prefill", (1, 2, 4), (1, 64, 256), (0, 0, 0))


def test_limits_account_for_every_profile():
    # batch: every profile must serve max_batch_size -> the prefill's 4, not the decode's 8
    assert profile_batch([DECODE, PREFILL]) == (4, 2)
    assert profile_batch([DECODE]) == (8, 4)
    # prompts are prefills (empty past): 256 from the prefill profile (the decode one takes no empty past);
    # context: decode (sequence 1) reaches past 511 + 1 = attention 512
    assert context_limits([DECODE, PREFILL]) == {"max_prompt_tokens": 256, "max_context": 512}
    assert context_limits([PREFILL]) == {"max_prompt_tokens": 256, "max_context": 1}
    assert context_limits([]) == {"max_prompt_tokens": 0, "max_context": 0}


def _io():
    from pipeline.artifacts import TensorSpec

    ins = [TensorSpec("input_ids", "int64", ["batch", "sequence"])]
    return ins, [TensorSpec("logits", "float32", ["batch", "sequence", 11])]


def test_tensorrt_config_lists_every_profile_and_the_check_holds_it():
    triton = make_recipe(max_batch_size=4, instance_group=[{"count": 2, "kind": "KIND_GPU"}]).triton
    ins, outs = _io()
    cfg = compute_config(triton, ins, outs, target="tensorrt", profile_count=2)
    assert [list(g.profile) for g in cfg.instance_group] == [["0", "1"]]
    assert 'profile: "0"' in str(cfg) and parse_config(str(cfg)) == cfg
    check_config(cfg, ins, outs, profile_max_batch=4, target="tensorrt", version_dirs=["1"], profile_count=2)
    one = compute_config(triton, ins, outs, target="tensorrt", profile_count=1)
    assert not one.instance_group[0].profile  # one profile: Triton's default (profile 0) is right
    with pytest.raises(TritonConfigError, match=r"instance_group\[0\].profile: empty, so Triton uses only profile 0"):
        check_config(one, ins, outs, profile_max_batch=4, target="tensorrt", version_dirs=["1"], profile_count=2)
    with pytest.raises(TritonConfigError, match=r"\['1'\] are not profile indices of the engine, which has 1"):
        check_config(cfg, ins, outs, profile_max_batch=4, target="tensorrt", version_dirs=["1"], profile_count=1)
    ort = compute_config(triton, ins, outs, target="onnxruntime", profile_count=2)
    assert not ort.instance_group[0].profile
    ort.instance_group[0].profile.append("0")
    with pytest.raises(TritonConfigError, match=r"optimization profiles exist only for target 'tensorrt'"):
        check_config(ort, ins, outs, profile_max_batch=4, target="onnxruntime", version_dirs=["1"], gpu_available=True)


def test_repository_with_two_profiles(stage, tmp_path):  # noqa: F811
    engine = tmp_path / "work" / "model.plan"
    engine.write_bytes(b"not really an engine")
    stage["build"] = BuildArtifact("ok", "", str(engine), None, "trtexec.sh", [DECODE, PREFILL])
    recipe = make_recipe(instance_group=[{"count": 1, "kind": "KIND_AUTO"}])
    write_repository(recipe, **stage)
    compute = parse_config((stage["out_dir"] / "tiny" / "config.pbtxt").read_text())
    assert list(compute.instance_group[0].profile) == ["0", "1"]
    assert list(compute.dynamic_batching.preferred_batch_size) == [2]  # the opt batch both profiles share
    generate = parse_config((stage["out_dir"] / "tiny_generate" / "config.pbtxt").read_text())
    assert generate.parameters["max_prompt_tokens"].string_value == "256"
    assert generate.parameters["max_context"].string_value == "512"
    with pytest.raises(TritonConfigError, match=r"max_batch_size: 8 is greater than the optimization profile's max "
                                                r"batch 4 \(the smallest over all profiles"):
        write_repository(make_recipe(max_batch_size=8, model_name="other",
                                     instance_group=[{"count": 1, "kind": "KIND_AUTO"}]), **stage)


def test_recipe_preflight_checks_max_batch_against_every_profile():
    two = {"build.profiles": [
        {"name": "decode", "dims": {"batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"min": 1, "opt": 1, "max": 1},
                                    "past_sequence": {"min": 0, "opt": 64, "max": 511},
                                    "total_sequence": {"min": 1, "opt": 65, "max": 512}}},
        {"name": "prefill", "dims": {"batch": {"min": 1, "opt": 2, "max": 4}, "sequence": {"min": 1, "opt": 64, "max": 256},
                                     "past_sequence": {"min": 0, "opt": 0, "max": 1},
                                     "total_sequence": {"min": 1, "opt": 64, "max": 257}}}]}
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {**two, "triton.max_batch_size": 4})
    assert [p.name for p in recipe.build.profiles] == ["decode", "prefill"]
    with pytest.raises(RecipeError, match=r"triton.max_batch_size: 8 is greater than the max batch 4 of "
                                          r"build.profiles\[1\] \('prefill'\)"):
        load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {**two, "triton.max_batch_size": 8})
