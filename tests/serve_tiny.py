"""Tiny models for the serve / bench tests: a BERT-like encoder with an INT8 Q/DQ weight and
a WordPiece tokenizer, a tiny KV-cache LM (from test_repository), their recipes and
the stage artifacts a finished run would hand to pipeline.serve."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from pipeline.artifacts import (
    BuildArtifact,
    ExportArtifact,
    QuantizedArtifact,
    ResolvedProfile,
    ValidationArtifact,
)
from pipeline.recipe.schema import Recipe, ServeConfig
from pipeline.onnx_io import graph_specs
import conftest  # noqa: F401,E402  (a subprocess that imports this module gets every test folder on its path)
from test_repository import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    build_artifact,
    make_recipe,
    tiny_llm,
    tiny_tokenizer,
)

HIDDEN = 8
ENC_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", ".",
             "in", "park", "and", "of", "to", "is", "it"]
ENC_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def tiny_encoder(path: Path, seed: int = 5) -> Path:
    """(input_ids, attention_mask, token_type_ids) int64 [batch, sequence] -> embeddings float32
    [batch, 8]: word + type embedding, an INT8 Q/DQ activation and weight into one MatMul,
    masked mean over the sequence, L2 normalisation (the encoder recipes' graph, in miniature)."""
    rng = np.random.default_rng(seed)
    i64, f32 = TensorProto.INT64, TensorProto.FLOAT
    inits = [
        numpy_helper.from_array(rng.normal(size=(len(ENC_WORDS), HIDDEN)).astype(np.float32), "word"),
        numpy_helper.from_array(rng.normal(size=(2, HIDDEN)).astype(np.float32), "types"),
        numpy_helper.from_array(rng.integers(-127, 128, (HIDDEN, HIDDEN)).astype(np.int8), "w_q"),
        numpy_helper.from_array(np.array(0.01, np.float32), "w_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "zp"),
        numpy_helper.from_array(np.array(0.05, np.float32), "a_scale"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        numpy_helper.from_array(np.array([2], np.int64), "axis2"),
        numpy_helper.from_array(np.array(1e-9, np.float32), "tiny"),
    ]
    nodes = [
        helper.make_node("Gather", ["word", "input_ids"], ["e_word"]),
        helper.make_node("Gather", ["types", "token_type_ids"], ["e_type"]),
        helper.make_node("Add", ["e_word", "e_type"], ["h"]),
        helper.make_node("QuantizeLinear", ["h", "a_scale", "zp"], ["h_q"]),
        helper.make_node("DequantizeLinear", ["h_q", "a_scale", "zp"], ["h_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "zp"], ["w"]),
        helper.make_node("MatMul", ["h_dq", "w"], ["h2"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=f32),
        helper.make_node("Unsqueeze", ["m", "axis2"], ["m3"]),
        helper.make_node("Mul", ["h2", "m3"], ["hm"]),
        helper.make_node("ReduceSum", ["hm", "axis1"], ["total"], keepdims=0),
        helper.make_node("ReduceSum", ["m3", "axis1"], ["count"], keepdims=0),
        helper.make_node("Max", ["count", "tiny"], ["count_c"]),
        helper.make_node("Div", ["total", "count_c"], ["pooled"]),
        helper.make_node("LpNormalization", ["pooled"], ["embeddings"], axis=-1, p=2),
    ]
    graph = helper.make_graph(
        nodes, "tiny_encoder",
        [helper.make_tensor_value_info(n, i64, ["batch", "sequence"]) for n in ENC_INPUTS],
        [helper.make_tensor_value_info("embeddings", f32, ["batch", HIDDEN])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def tiny_wordpiece(folder: Path) -> Path:
    """BERT-style WordPiece tokenizer ([CLS] text [SEP], lower case) with pad_token [PAD] (id 0)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(ENC_WORDS)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"pad_token": "[PAD]", "model_max_length": 64}))
    return folder


def encoder_profiles(batch_max: int = 8, seq_max: int = 64) -> list[ResolvedProfile]:
    shape = {"min": [1, 1], "opt": [4, 16], "max": [batch_max, seq_max]}
    return [ResolvedProfile("default", {n: shape for n in ENC_INPUTS})]


def encoder_recipe(ws: Path, serve: dict | None = None, **triton) -> Recipe:
    """An encoder recipe writing into ``ws`` (work_dir, output_dir); ``triton`` overrides."""
    data = {
        "name": "tiny-encoder",
        "model": {"kind": "sentence-embedding", "source": {"path": "tiny"}},
        "export": {"dynamic_axes": {n: {0: "batch", 1: "sequence"} for n in ENC_INPUTS}},
        "quantize": {"precision": "fp32"},
        "build": {"profiles": [{"name": "default"}]},
        "validate": {"data": {"type": "corpus", "name": "lee_background", "split": {"start": 220, "stop": 230}},
                     "gates": []},
        "triton": {"model_name": "tiny_enc", "max_batch_size": 8, "target": "python-onnxruntime",
                   "dynamic_batching": {"max_queue_delay_microseconds": 50000},
                   "instance_group": [{"count": 1, "kind": "KIND_CPU"}], **triton},
        "serve": serve or {},
        "work_dir": str(ws / "artifacts"), "output_dir": str(ws / "model_repository"),
    }
    return Recipe.model_validate(data)


def encoder_artifacts(ws: Path) -> dict:
    """Stage artifacts of a finished tiny-encoder run (no engine, no greedy tokens)."""
    path = tiny_encoder(ws / "work" / "encoder.onnx")
    inputs, outputs = graph_specs(onnx.load(str(path)))
    build = BuildArtifact("skipped", "tensorrt not installed", None, None, "trtexec.sh", encoder_profiles())
    return {
        "export": ExportArtifact(str(path), inputs, outputs, str(tiny_wordpiece(ws / "work" / "tokenizer"))),
        "quantize": QuantizedArtifact(str(path), "int8", ["MatMul"], []),
        "build": build,
        "validate": ValidationArtifact({}, [], {}),
    }


def llm_recipe(ws: Path, serve: dict | None = None, **triton) -> Recipe:
    """test_triton_repository's tiny LLM recipe, writing into ``ws``, with a ``serve`` section."""
    recipe = make_recipe(**triton)
    return recipe.model_copy(update={"work_dir": str(ws / "artifacts"), "output_dir": str(ws / "model_repository"),
                                     "serve": ServeConfig.model_validate(serve or {})})


def llm_artifacts(ws: Path, prompts: list[list[int]] | None = None, *, tokenizer_dir: Path | None = None,
                  build: BuildArtifact | None = None, greedy_tokens: list[list[int]] | None = None) -> dict:
    """Stage artifacts of a finished tiny-LLM run: FP32 export, FP8 Q/DQ graph, greedy prompts
    (and the validate stage's fp8 greedy tokens for them, if given). ``tokenizer_dir``: default
    test_triton_repository's WordLevel tokenizer; ``build``: default its 33-token context."""
    onnx_path = tiny_llm(ws / "work" / "model.onnx")
    inputs, outputs = graph_specs(onnx.load(str(onnx_path)))
    qdq = tiny_llm(ws / "work" / "model.qdq.onnx", qdq=True)
    greedy: dict = {"prompt_ids": prompts or [[1, 2, 3], [4, 5, 6]]}
    if greedy_tokens is not None:
        greedy["fp8"] = greedy_tokens
    tokenizer_dir = tokenizer_dir or tiny_tokenizer(ws / "work" / "tokenizer")
    return {
        "export": ExportArtifact(str(onnx_path), inputs, outputs, str(tokenizer_dir)),
        "quantize": QuantizedArtifact(str(qdq), "fp8", ["lm_head"], []),
        "build": build or build_artifact(),
        "validate": ValidationArtifact({}, [], greedy),
    }


#: Pieces of :func:`tiny_metaspace`; ids 0..10 are the tiny LM's vocabulary.
METASPACE_PIECES = ["<eos>", "<unk>", "\u2581the", "at", "\u2581c", "\u2581s", "\u2581m", "\u2581on", ".",
                    "\u2581", "t"]


def tiny_metaspace(folder: Path, eos_ids: tuple[int, ...] = (0,)) -> Path:
    """A SentencePiece-style tokenizer: Unigram over :data:`METASPACE_PIECES` (ids 0..10) and
    the 256 byte-fallback tokens ``<0x00>``..``<0xFF>`` (ids 11..266), Metaspace pre-tokenizer,
    ByteFallback + Metaspace decoder; ``<eos>`` special. generation_config.json names
    ``eos_ids`` as the EOS ids."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = [(p, -1.0) for p in METASPACE_PIECES] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=1, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tok.add_special_tokens(["<eos>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos_ids)}))
    return folder


def context_build(context: int, prompt_max: int = 16, batch_max: int = 4) -> BuildArtifact:
    """A skipped build whose profile gives the tiny LM a ``context``-token limit
    (attention_mask max ``context``, past max ``context - 1``) and ``prompt_max``-token prompts."""
    kv = {"min": [1, HEADS, 0, HEAD_DIM], "opt": [1, HEADS, 8, HEAD_DIM],
          "max": [batch_max, HEADS, context - 1, HEAD_DIM]}
    shapes = {
        "input_ids": {"min": [1, 1], "opt": [1, 8], "max": [batch_max, prompt_max]},
        "attention_mask": {"min": [1, 1], "opt": [1, 16], "max": [batch_max, context]},
        **{f"past_key_values.{i}.{k}": kv for i in range(LAYERS) for k in ("key", "value")},
    }
    return BuildArtifact("skipped", "tensorrt not installed", None, None, "trtexec.sh",
                         [ResolvedProfile("default", shapes)])


def with_validate_greedy(served, new_tokens: int, change: dict[int, list[int]] | None = None):
    """``served`` whose validate artifact holds its prompts' batch-1 greedy tokens of the quantized graph,
    decoded as the validate stage decodes them (:class:`pipeline.serve.check._BatchOneReference`);
    ``change``: prompt index -> tokens recorded instead (a stale or wrong record)."""
    from dataclasses import replace

    from pipeline.serve.check import _BatchOneReference

    greedy = dict(served.artifacts["validate"].greedy_tokens)
    reference = _BatchOneReference(served)
    tokens = [reference(p, new_tokens)[0] for p in greedy["prompt_ids"]]
    greedy[served.artifacts["quantize"].precision] = [(change or {}).get(i, t) for i, t in enumerate(tokens)]
    return replace(served, artifacts={**served.artifacts, "validate": ValidationArtifact({}, [], greedy)})


def _idle_statistics(server, model: str, timeout_s: float) -> dict | None:
    """``model``'s scheduler statistics once it has no request in flight (``inflight``), or the
    last ones read when ``timeout_s`` passed first; None when the model did not answer."""
    import time

    from pipeline.serve.client import scheduler_statistics

    deadline = time.monotonic() + timeout_s  # a bound on the wait, not a speed bound
    stats = scheduler_statistics(server.grpc_url, model)
    while stats and stats.get("inflight") and time.monotonic() < deadline:
        time.sleep(0.2)
        stats = scheduler_statistics(server.grpc_url, model)
    return stats


def stop_when_idle(server, model: str, timeout_s: float = 300.0) -> int:
    """Stop ``server`` (a TritonServer) once ``model`` has no request in flight (its scheduler
    statistics' ``inflight``); its exit status. tritonserver drains requests in flight at
    shutdown for its exit timeout only (30 s), so a generation still streaming (a long one, a
    late cancel) would fail the exit status of an otherwise clean stop.

    Raises:
        AssertionError: still busy after ``timeout_s`` (the message has the statistics and the
            end of the server's log).
    """
    stats = _idle_statistics(server, model, timeout_s)
    busy = bool(stats and stats.get("inflight"))
    logs = server.logs()[-3000:] if busy else ""
    code = server.stop()
    assert not busy, f"{model} still generating after {timeout_s:g} s: {stats}\n{logs}"
    return code


#: What tritonserver 2.51 logs when it gives up unloading a model: here, now and then after a
#: cancelled stream, the python backend never sent ``model``'s stub the finalize call (seen with
#: py-spy: the stub's main thread idle, its scheduler waiting for work) and the server exited 1
#: after its exit timeout (30 s). triton-inference-server/server issue 8755 reports the same stub
#: state for the in-process API on 2.67.
UNLOAD_TIMEOUT = "Exit timeout expired"


def stop_cleanly(server, model: str, timeout_s: float = 300.0) -> None:
    """Stop ``server`` once ``model`` is idle and check it stopped cleanly: exit 0, or the
    upstream unload hang above, reported as a warning, where all three hold: ``model``
    answered its statistics idle just before the stop, the exit timeout expired, and
    ``model``'s finalize was never called (its first log line, ``<model>: finalize:``, absent).
    A model that did not answer, or a finalize that started and hung, fails as any other exit.

    Raises:
        AssertionError: ``model`` still busy after ``timeout_s``, or any other non-zero exit
            (with the end of the server's log).
    """
    import warnings

    stats = _idle_statistics(server, model, timeout_s)
    code = server.stop()
    logs = server.logs()
    assert not (stats and stats.get("inflight")), f"{model} still generating after {timeout_s:g} s: {stats}"
    if code and stats is not None and UNLOAD_TIMEOUT in logs and f"{model}: finalize:" not in logs:
        warnings.warn(f"tritonserver exited {code}: it never called {model}'s finalize and its exit timeout "
                      "expired (an upstream unload hang; tests/serve_tiny.py UNLOAD_TIMEOUT)")
        return
    assert code == 0, logs[-3000:]
