"""Triton configs: built as ModelConfig, parse back, and each refusal of check_config."""
from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.artifacts import TensorSpec
from pipeline.errors import TritonConfigError
from pipeline.recipe.schema import TritonConfig
from pipeline.triton.config import (
    GENERATE_INPUTS,
    GENERATE_OUTPUTS,
    check_config,
    compute_config,
    config_dims,
    generate_config,
    parse_config,
    to_text,
)

LAYERS, HEADS, HEAD_DIM, VOCAB = 2, 1, 4, 11


def llm_io() -> tuple[list[TensorSpec], list[TensorSpec]]:
    """I/O of the KV-cache LM export: 2 layers, kv_heads 1, head_dim 4, vocab 11."""
    past = [
        TensorSpec(f"past_key_values.{i}.{k}", "float32", ["batch", HEADS, "past_sequence", HEAD_DIM])
        for i in range(LAYERS) for k in ("key", "value")
    ]
    present = [
        TensorSpec(f"present.{i}.{k}", "float32", ["batch", HEADS, "past_sequence + sequence", HEAD_DIM])
        for i in range(LAYERS) for k in ("key", "value")
    ]
    inputs = [
        TensorSpec("input_ids", "int64", ["batch", "sequence"]),
        TensorSpec("attention_mask", "int64", ["batch", "total_sequence"]),
        *past,
    ]
    return inputs, [TensorSpec("logits", "float32", ["batch", "sequence", VOCAB]), *present]


def triton(**kw) -> TritonConfig:
    base = dict(model_name="tiny", max_batch_size=4, dynamic_batching={"max_queue_delay_microseconds": 200},
                instance_group=[{"count": 2, "kind": "KIND_CPU"}])
    return TritonConfig.model_validate({**base, **kw})


def build(target="onnxruntime", **kw) -> mc.ModelConfig:
    inputs, outputs = llm_io()
    return compute_config(triton(**kw), inputs, outputs, target=target, profile_opt_batch=2)


def check(cfg, target="onnxruntime", *, io=None, profile_max_batch=4, version_dirs=("1",), **kw) -> None:
    inputs, outputs = io or llm_io()
    check_config(cfg, inputs, outputs, profile_max_batch=profile_max_batch, target=target,
                 version_dirs=list(version_dirs), **kw)


def refused(match: str, cfg, **kw) -> str:
    with pytest.raises(TritonConfigError, match=match) as err:
        check(cfg, **kw)
    assert f"model '{cfg.name}'" in str(err.value)
    return str(err.value)


@pytest.mark.parametrize(
    "target,platform,backend",
    [("onnxruntime", "onnxruntime_onnx", ""), ("tensorrt", "tensorrt_plan", ""), ("python-onnxruntime", "", "python")],
)
def test_compute_config_parses_and_round_trips(target, platform, backend):
    kind = "KIND_GPU" if target == "tensorrt" else "KIND_CPU"
    cfg = build(target, instance_group=[{"count": 2, "kind": kind}])
    parsed = parse_config(to_text(cfg))
    assert isinstance(parsed, mc.ModelConfig) and parsed == cfg
    assert (parsed.platform, parsed.backend) == (platform, backend)
    assert parsed.max_batch_size == 4
    by_name = {t.name: t for t in [*parsed.input, *parsed.output]}
    assert list(by_name["input_ids"].dims) == [-1]
    assert list(by_name["past_key_values.1.value"].dims) == [HEADS, -1, HEAD_DIM]
    assert list(by_name["logits"].dims) == [-1, VOCAB]
    assert by_name["input_ids"].data_type == mc.TYPE_INT64
    assert by_name["logits"].data_type == mc.TYPE_FP32
    assert parsed.dynamic_batching.max_queue_delay_microseconds == 200
    assert list(parsed.dynamic_batching.preferred_batch_size) == [2]  # profile opt batch
    assert [(g.count, mc.ModelInstanceGroup.Kind.Name(g.kind)) for g in parsed.instance_group] == [(2, kind)]
    check(cfg, target)


def test_python_onnxruntime_names_its_onnx_file():
    cfg = build("python-onnxruntime")
    assert cfg.parameters["onnx_file"].string_value == "model.onnx"


def test_qdq_graphs_get_basic_onnxruntime_optimizations():
    inputs, outputs = llm_io()
    ort_cfg = compute_config(triton(), inputs, outputs, target="onnxruntime", qdq=True)
    assert ort_cfg.optimization.graph.level == -1
    assert not build("onnxruntime").HasField("optimization")
    py_cfg = compute_config(triton(), inputs, outputs, target="python-onnxruntime", qdq=True)
    assert py_cfg.parameters["graph_optimization_level"].string_value == "basic"
    assert build("python-onnxruntime").parameters["graph_optimization_level"].string_value == "all"
    trt = compute_config(triton(instance_group=[{"kind": "KIND_GPU"}]), inputs, outputs, target="tensorrt", qdq=True)
    assert not trt.HasField("optimization") and not trt.parameters


def test_recipe_preferred_batch_size_wins_and_unbatched_dims_are_full_shapes():
    cfg = build(dynamic_batching={"max_queue_delay_microseconds": 5, "preferred_batch_size": [4]})
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4]
    flat = build(max_batch_size=0, dynamic_batching=None)
    assert list(flat.input[0].dims) == [-1, -1]
    assert list(flat.output[0].dims) == [-1, -1, VOCAB]
    assert not flat.HasField("dynamic_batching")
    check(flat)


def test_config_dims_symbolic_to_minus_one():
    assert config_dims(["batch", 3, "s", -1], batched=True) == [3, -1, -1]
    assert config_dims([1, "s"], batched=False) == [1, -1]


def test_graph_dtype_without_triton_type_is_refused():
    inputs, outputs = llm_io()
    inputs[2] = TensorSpec("past_key_values.0.key", "FLOAT8E4M3FN", ["batch", HEADS, "past", HEAD_DIM])
    with pytest.raises(TritonConfigError, match=r"model 'tiny': input 'past_key_values.0.key': dtype 'FLOAT8E4M3FN' "
                                                r"has no Triton data type"):
        compute_config(triton(), inputs, outputs, target="onnxruntime")


def test_parse_config_error_is_a_pipeline_error():
    with pytest.raises(TritonConfigError, match="does not parse as ModelConfig"):
        parse_config('name: "x"\nmax_batch_size: "eight"\n')


def test_refuses_input_name_not_in_graph():
    cfg = build()
    cfg.input[0].name = "ids"
    refused(r"input\[0\] 'ids': not a model input", cfg)


def test_refuses_graph_input_missing_from_config():
    cfg = build()
    del cfg.input[1]
    refused(r"model input\(s\) \['attention_mask'\] are missing", cfg)


def test_refuses_dtype_mismatch():
    cfg = build()
    cfg.input[0].data_type = mc.TYPE_INT32
    refused(r"input\[0\] 'input_ids'.data_type: TYPE_INT32 does not match the model's int64 \(TYPE_INT64\)", cfg)


def test_refuses_rank_mismatch():
    cfg = build()
    cfg.input[2].dims[:] = [HEADS, -1]
    refused(r"past_key_values.0.key'.dims: rank 2 .* does not match the model's rank 3", cfg)


def test_refuses_fixed_dim_mismatch():
    cfg = build()
    cfg.output[0].dims[:] = [-1, VOCAB + 1]
    refused(r"output\[0\] 'logits'.dims\[1\]: 12 does not fit the model's dim 11", cfg)


def test_refuses_dims_including_batch_axis():
    cfg = build()
    cfg.input[0].dims[:] = [-1, -1]
    refused(r"dims: \[-1, -1\] include the batch axis; with max_batch_size 4 > 0 dims exclude it", cfg)


def test_refuses_batching_on_fixed_batch_graph():
    inputs, outputs = llm_io()
    inputs[0] = TensorSpec("input_ids", "int64", [1, "sequence"])
    cfg = build()
    refused(r"max_batch_size: batching is enabled but 'input_ids' has a fixed batch axis", cfg, io=(inputs, outputs))
    unbatched = build(max_batch_size=0)  # dynamic_batching alone also batches
    refused(r"dynamic_batching: batching is enabled but 'input_ids' has a fixed batch axis", unbatched,
            io=(inputs, outputs))


def test_refuses_output_that_is_not_a_model_output():
    cfg = build()
    cfg.output.add(name="hidden_states", data_type=mc.TYPE_FP32, dims=[-1, 4])
    refused(r"output\[5\] 'hidden_states': not a model output", cfg)


def test_accepts_output_subset():
    cfg = build()
    del cfg.output[1:]
    check(cfg)


def test_refuses_max_batch_above_profile_max():
    cfg = build(max_batch_size=8)
    refused(r"max_batch_size: 8 is greater than the optimization profile's max batch 4", cfg)
    check(cfg, profile_max_batch=None)


def test_refuses_preferred_batch_above_max_batch():
    cfg = build(dynamic_batching={"preferred_batch_size": [2, 6]})
    refused(r"preferred_batch_size: 6 is outside 1..max_batch_size \(4\)", cfg)


def test_refuses_gpu_kind_on_cpu_only_targets():
    gpu = [{"count": 1, "kind": "KIND_GPU"}]
    refused(r"instance_group\[0\].kind: KIND_GPU on CPU-only target 'onnxruntime' \(no GPU was found",
            build(instance_group=gpu))
    check(build(instance_group=gpu), gpu_available=True)
    check(build(instance_group=[{"kind": "KIND_AUTO"}]))
    refused(r"KIND_GPU on CPU-only target 'python-onnxruntime' \(it runs ONNX Runtime's CPU provider",
            build("python-onnxruntime", instance_group=gpu), target="python-onnxruntime", gpu_available=True)


def test_refuses_tensorrt_plan_on_cpu():
    cfg = build("tensorrt", instance_group=[{"count": 1, "kind": "KIND_GPU"}, {"count": 1, "kind": "KIND_CPU"}])
    refused(r"instance_group\[1\].kind: KIND_CPU cannot run a tensorrt_plan", cfg, target="tensorrt")


def test_refuses_config_for_another_target():
    refused(r"platform/backend: platform 'onnxruntime_onnx' .* does not serve target 'tensorrt'", build(),
            target="tensorrt")
    refused(r"target: 'triton' is not one of", build(), target="triton")


def test_refuses_missing_version_folder():
    refused(r"version folder: no numeric version folder .* found \['config.pbtxt', 'v1'\]", build(),
            version_dirs=["config.pbtxt", "v1"])
    cfg = build()
    cfg.version_policy.specific.versions.extend([1, 3])
    refused(r"version_policy.specific.versions: version folder\(s\) \[3\] do not exist", cfg, version_dirs=["1", "2"])


def test_reshape_must_keep_element_count():
    inputs, outputs = llm_io()
    inputs.append(TensorSpec("scale", "float32", ["batch", 2, 3]))
    cfg = build()
    cfg.input.add(name="scale", data_type=mc.TYPE_FP32, dims=[6])
    cfg.input[-1].reshape.shape.extend([2, 3])
    check(cfg, io=(inputs, outputs))  # reshape is what the model sees: [2, 3]
    cfg.input[-1].reshape.shape[:] = [2, 4]
    refused(r"input\[6\] 'scale'.reshape: shape \[2, 4\] does not hold the same number of elements as dims \[6\]",
            cfg, io=(inputs, outputs))


def test_refuses_duplicate_entry():
    cfg = build()
    cfg.input.append(cfg.input[0])
    refused(r"input\[6\] 'input_ids': listed twice", cfg)


def test_generate_config_is_decoupled_and_carries_the_numbers():
    cfg = generate_config("tiny_generate", compute_model="tiny", num_layers=LAYERS, kv_heads=HEADS,
                          head_dim=HEAD_DIM, kv_dtype="float32", eos_token_ids=[0, 7], default_max_tokens=6,
                          max_context=33, max_prompt_tokens=16)
    parsed = parse_config(to_text(cfg))
    assert parsed == cfg
    assert parsed.model_transaction_policy.decoupled is True
    assert parsed.backend == "python" and parsed.max_batch_size == 0
    params = {k: v.string_value for k, v in parsed.parameters.items()}
    assert params == {"compute_model": "tiny", "num_layers": "2", "kv_heads": "1", "head_dim": "4",
                      "kv_dtype": "float32", "eos_token_ids": "0,7", "default_max_tokens": "6",
                      "max_context": "33", "max_prompt_tokens": "16", "max_concurrent_generations": "1",
                      "continuous_batching": "1", "kv_cache_budget_mib": "0.0", "compute_runtime": "bls"}
    io = {t.name: (mc.DataType.Name(t.data_type), list(t.dims)) for t in [*parsed.input, *parsed.output]}
    assert io == {"text_input": ("TYPE_STRING", [1]), "max_tokens": ("TYPE_INT32", [1]),
                  "input_ids": ("TYPE_INT64", [-1]), "ignore_eos": ("TYPE_BOOL", [1]),
                  "messages": ("TYPE_STRING", [1]), "temperature": ("TYPE_FP32", [1]),
                  "top_k": ("TYPE_INT32", [1]), "top_p": ("TYPE_FP32", [1]), "seed": ("TYPE_INT64", [1]),
                  "stop": ("TYPE_STRING", [-1]), "scheduler_stats": ("TYPE_BOOL", [1]),
                  "prompt_logprobs": ("TYPE_INT32", [1]), "logprobs": ("TYPE_INT32", [1]),
                  "text_output": ("TYPE_STRING", [1]), "token_ids": ("TYPE_INT64", [1]),
                  "finish_reason": ("TYPE_STRING", [1]), "detail": ("TYPE_STRING", [1]),
                  "scores": ("TYPE_STRING", [1])}
    assert [t.optional for t in parsed.input] == [True] * 13
    check_config(parsed, GENERATE_INPUTS, GENERATE_OUTPUTS, profile_max_batch=None, target="python",
                 version_dirs=["1"])
