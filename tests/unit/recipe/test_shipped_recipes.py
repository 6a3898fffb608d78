"""Every shipped recipe resolves to Triton configs that pass check_config, both on a
CPU-only machine (no engine: target onnxruntime) and where an engine was built
(target tensorrt). A KIND_CPU instance group made fp8-llm unpublishable
right after a successful GPU build."""
from __future__ import annotations

import pytest

from conftest import ROOT
from pipeline.artifacts import TensorSpec
from pipeline.trt.profiles import resolve_profiles
from pipeline.recipe.schema import InstanceGroup, Recipe
from pipeline.recipe.load import load_recipe
from pipeline.triton.config import (
    GENERATE_INPUTS,
    GENERATE_OUTPUTS,
    check_config,
    check_ensemble,
    compute_config,
    ensemble_config,
    generate_config,
    tokenizer_config,
)
from pipeline.triton.repository import profile_batch

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
LAYERS, HEADS, HEAD_DIM, VOCAB, HIDDEN = 2, 3, 64, 49152, 384


def fake_io(recipe: Recipe) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Graph I/O as the recipe's export would produce it (symbolic dims from dynamic_axes)."""
    axes = recipe.export.dynamic_axes
    if recipe.model.kind == "image-classification":
        return [TensorSpec("x", "float32", ["batch", 3, 48, 192])], [TensorSpec("probs", "float32", ["batch", 2])]
    inputs = [TensorSpec(name, "int64", [dims[0], dims[1]]) for name, dims in axes.items()]
    if recipe.model.kind == "sentence-embedding":
        return inputs, [TensorSpec("embeddings", "float32", [axes["input_ids"][0], HIDDEN])]
    batch, seq = axes["input_ids"][0], axes["input_ids"][1]
    past = [TensorSpec(f"past_key_values.{i}.{k}", "float32", [batch, HEADS, "past_sequence", HEAD_DIM])
            for i in range(LAYERS) for k in ("key", "value")]
    present = [TensorSpec(f"present.{i}.{k}", "float32", [batch, HEADS, "present_sequence", HEAD_DIM])
               for i in range(LAYERS) for k in ("key", "value")]
    return inputs + past, [TensorSpec("logits", "float32", [batch, seq, VOCAB]), *present]


@pytest.mark.parametrize("name", RECIPES)
def test_every_shipped_recipe_uses_kind_auto(name):
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    assert [g.kind for g in recipe.triton.instance_group] == ["KIND_AUTO"]
    assert InstanceGroup().kind == "KIND_AUTO"


@pytest.mark.parametrize("target, gpu", [("onnxruntime", False), ("tensorrt", True)])
@pytest.mark.parametrize("name", RECIPES)
def test_shipped_recipe_configs_pass_on_cpu_and_with_an_engine(name, target, gpu):
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    inputs, outputs = fake_io(recipe)
    max_batch, opt_batch = profile_batch(resolve_profiles(list(recipe.build.profiles), inputs))
    assert max_batch == recipe.triton.max_batch_size  # the shipped recipes use the whole profile
    compute = compute_config(recipe.triton, inputs, outputs, target=target, profile_opt_batch=opt_batch, qdq=True)
    check_config(compute, inputs, outputs, profile_max_batch=max_batch, target=target, version_dirs=["1"],
                 gpu_available=gpu)
    assert compute.platform == {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}[target]
    assert list(compute.dynamic_batching.preferred_batch_size) == [opt_batch]

    if recipe.model.kind == "text-generation":  # the generation model: python backend, whatever the target
        gen = generate_config(str(recipe.triton.generate_model_name), compute_model=recipe.triton.model_name,
                              num_layers=LAYERS, kv_heads=HEADS, head_dim=HEAD_DIM, kv_dtype="float32",
                              eos_token_ids=[2], default_max_tokens=32)
        check_config(gen, GENERATE_INPUTS, GENERATE_OUTPUTS, profile_max_batch=None, target="python",
                     version_dirs=["1"], gpu_available=gpu)
        return
    if recipe.model.kind == "image-classification":  # preprocessing model + image -> class ensemble
        from pipeline.models.image_classification import serving

        name, h, w = serving.graph_image_size(inputs)
        pre = serving.preprocess_config(serving.preprocess_model_name(recipe.triton.model_name),
                                        max_batch_size=recipe.triton.max_batch_size, output=name, height=h, width=w)
        image = [TensorSpec(serving.IMAGE_INPUT, "object", ["batch", 1])]
        check_config(pre, image, [TensorSpec(name, "float32", ["batch", 3, h, w])], profile_max_batch=None,
                     target="python", version_dirs=["1"], gpu_available=gpu)
        ens = serving.ensemble_config(serving.ensemble_model_name(recipe.triton.model_name), pre, compute)
        check_ensemble(ens, {m.name: m for m in (pre, compute)})
        check_config(ens, image, outputs, profile_max_batch=None, target="ensemble", version_dirs=["1"],
                     gpu_available=gpu)
        return
    names = [s.name for s in inputs]  # encoder: tokenizer model + text -> embedding ensemble
    tok = tokenizer_config(f"{recipe.triton.model_name}_tokenizer", max_batch_size=recipe.triton.max_batch_size,
                           outputs=names, max_length=256, pad_id=0, pad_to_multiple_of=16)
    text = [TensorSpec("text", "object", ["batch", 1])]
    check_config(tok, text, [TensorSpec(n, "int64", ["batch", "sequence"]) for n in names], profile_max_batch=None,
                 target="python", version_dirs=["1"], gpu_available=gpu)
    ens = ensemble_config(f"{recipe.triton.model_name}_ensemble", tok, compute)
    check_ensemble(ens, {m.name: m for m in (tok, compute)})
    check_config(ens, text, outputs, profile_max_batch=None, target="ensemble", version_dirs=["1"],
                 gpu_available=gpu)
