"""The generation model's in-flight batching scheduler, sampling, stop strings and chat template
, against a stand-in triton_python_backend_utils. The compute graph
here honours the attention mask: a causal masked mean over the cache, with position ids from the
mask's cumulative sum (as the exported LLM derives them), so wrong padding changes the logits."""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer

from pipeline.models.text_generation.served import chat, decoding
from pipeline.artifacts import ExportArtifact, QuantizedArtifact
from pipeline.onnx_io import graph_specs
from pipeline.triton.config import parse_config
from pipeline.stages.triton import write_repository
from test_serve_generation import CancellingRequest, fake_backend
from tiny import continuation
from test_repository import (
    EOS, HEAD_DIM, HEADS, LAYERS, VOCAB, FakeRequest, build_artifact, load_template, make_recipe, ort_session,
    reference_generate, tiny_llm, tiny_tokenizer,
)

CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + ' <eos> ' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ 'j' }}{% endif %}")


def masked_llm(path: Path, seed: int = 7, last_logits: bool = False) -> Path:
    """KV-cache LM with the export's I/O whose output depends on mask and positions:
    h = embed(ids) + pos_embed(cumsum(mask) - 1); present = past ++ h;
    logits = (h + mean of the last layer's unmasked cache entries up to each query) @ lm_head."""
    rng = np.random.default_rng(seed)
    past = [f"past_key_values.{i}.{k}" for i in range(LAYERS) for k in ("key", "value")]
    present = [f"present.{i}.{k}" for i in range(LAYERS) for k in ("key", "value")]
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inits = [numpy_helper.from_array(rng.normal(size=(VOCAB, HEAD_DIM)).astype(np.float32), "embed"),
             numpy_helper.from_array(rng.normal(size=(64, HEAD_DIM)).astype(np.float32), "pos_embed"),
             numpy_helper.from_array(rng.normal(size=(HEAD_DIM, VOCAB)).astype(np.float32) * 3, "lm_head"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array(1, np.int64), "one_s"),
             numpy_helper.from_array(np.array(0, np.int64), "zero_s"),
             numpy_helper.from_array(np.array([2], np.int64), "two"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
             numpy_helper.from_array(np.array([2**31], np.int64), "end"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps")]
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Gather", ["ids_shape", "one"], ["n"]),
        helper.make_node("Neg", ["n"], ["minus_n"]),
        helper.make_node("CumSum", ["attention_mask", "one_s"], ["cum"]),
        helper.make_node("Sub", ["cum", "one_s"], ["pos_all"]),
        helper.make_node("Max", ["pos_all", "zero_s"], ["pos_clamped"]),
        helper.make_node("Slice", ["pos_clamped", "minus_n", "end", "one"], ["pos"]),
        helper.make_node("Gather", ["embed", "input_ids"], ["x"]),
        helper.make_node("Gather", ["pos_embed", "pos"], ["p"]),
        helper.make_node("Add", ["x", "p"], ["h"]),
        helper.make_node("Unsqueeze", ["h", "one"], ["h4"]),
        *[helper.make_node("Concat", [a, "h4"], [b], axis=2) for a, b in zip(past, present)],
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=f32),
        helper.make_node("Unsqueeze", ["mask_f", "one"], ["mask3"]),
        helper.make_node("Unsqueeze", ["mask3", "minus_one"], ["mask4"]),  # [B, 1, T, 1]
        helper.make_node("Mul", [present[-1], "mask4"], ["masked"]),
        helper.make_node("CumSum", ["masked", "two"], ["ctx_sum"]),
        helper.make_node("CumSum", ["mask4", "two"], ["ctx_count"]),
        helper.make_node("Slice", ["ctx_sum", "minus_n", "end", "two"], ["sum_n"]),
        helper.make_node("Slice", ["ctx_count", "minus_n", "end", "two"], ["count_n"]),
        helper.make_node("Max", ["count_n", "eps"], ["count_c"]),
        helper.make_node("Div", ["sum_n", "count_c"], ["mean4"]),
        helper.make_node("ReduceSum", ["mean4", "one"], ["mean"], keepdims=0),
        helper.make_node("Add", ["h", "mean"], ["out"]),
        helper.make_node("MatMul", ["out", "lm_head"], ["logits"]),
    ]
    extra = []
    if last_logits:  # logits[:, -1, :], as the export adds it
        nodes += [helper.make_node("Slice", ["logits", "minus_one", "end", "one"], ["last3"]),
                  helper.make_node("Squeeze", ["last3", "one"], ["last_logits"])]
        extra = [helper.make_tensor_value_info("last_logits", f32, ["batch", VOCAB])]
    kv = ["batch", HEADS, "past_sequence", HEAD_DIM]
    graph = helper.make_graph(
        nodes, "masked_llm",
        [helper.make_tensor_value_info("input_ids", i64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", i64, ["batch", "total_sequence"]),
         *[helper.make_tensor_value_info(n, f32, kv) for n in past]],
        [helper.make_tensor_value_info("logits", f32, ["batch", "sequence", VOCAB]),
         *[helper.make_tensor_value_info(n, f32, ["batch", HEADS, "total", HEAD_DIM]) for n in present], *extra],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def repository(tmp_path: Path, onnx_path: Path | None = None, chat: bool = True, **triton) -> Path:
    """Repository for the masked LM (or ``onnx_path``) with the WordLevel tokenizer (EOS '<eos>' = 0),
    a 33-token context and 16-token prefill chunks; returns the repository folder."""
    onnx_path = onnx_path or masked_llm(tmp_path / "work" / "masked.onnx")
    tok_dir = tiny_tokenizer(tmp_path / "work" / "tokenizer")
    if chat:
        (tok_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    inputs, outputs = graph_specs(onnx.load(str(onnx_path)))
    export = ExportArtifact(str(onnx_path), inputs, outputs, str(tok_dir))
    out = tmp_path / "repo"
    write_repository(make_recipe(**triton), export=export, quantized=QuantizedArtifact(str(onnx_path), "fp32", [], []),
                     build=build_artifact(), out_dir=out)
    return out


class Recorder:
    """Wraps the model's compute: records each call's input_ids and attention_mask, and the
    requests of each step; raises for a call with an input_ids row equal to ``poison``.

    ``pause_when``: a condition checked before each call; the first time it holds, the scheduler
    thread stops there (``paused`` is set) until ``resume()``, so a test can queue requests at a
    known step of another request's generation rather than race the scheduler."""

    def __init__(self, model, poison: list[int] | None = None, pause_when=None):
        self.inner, self.poison, self.calls, self.steps = model.compute, poison, [], []
        self.pause_when, self.paused, self._go = pause_when, threading.Event(), threading.Event()
        model.compute = self
        forward = model._forward
        model._forward = lambda seqs, n: self.steps.append([s.request for s in seqs]) or forward(seqs, n)

    def resume(self) -> None:
        self._go.set()

    def __call__(self, feeds):
        if self.pause_when is not None and not self.paused.is_set() and self.pause_when():
            self.paused.set()
            assert self._go.wait(120), "the test never resumed the scheduler"
        self.calls.append((feeds["input_ids"].copy(), feeds["attention_mask"].copy()))
        if self.poison is not None and any(row.tolist() == self.poison for row in feeds["input_ids"]):
            raise RuntimeError(f"poisoned prompt {self.poison}")
        return self.inner(feeds)


@pytest.fixture
def masked(tmp_path, monkeypatch):
    """(generation model with max_batch_size 4, the masked graph's path)."""
    repo = repository(tmp_path)
    fake_backend(monkeypatch, ort_session(tmp_path / "work" / "masked.onnx"))
    model = load_template(repo / "tiny_generate")
    model.tokenizer_file = tmp_path / "work" / "tokenizer" / "tokenizer.json"
    yield model, tmp_path / "work" / "masked.onnx"
    model.finalize()


def ids_request(ids, max_tokens=None, cls=FakeRequest, **extra):
    arrays = {"input_ids": np.array(ids, np.int64)}
    if max_tokens is not None:
        arrays["max_tokens"] = np.array([max_tokens], np.int32)
    return cls(**{**arrays, **extra})


def tokens(request) -> list[int]:
    return [int(r.outputs["token_ids"][0]) for r, _ in request.sent if "token_ids" in r.outputs]


def final(request) -> dict:
    response, flags = request.sent[-1]
    assert flags == 1
    return {k: v[0].decode() for k, v in response.outputs.items() if k in ("finish_reason", "detail")}


def wait_for(condition, what: str, limit_s: float = 60.0) -> None:
    """Poll until ``condition()``; a hang guard, not a speed bound."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def run(model, *requests, all_queued: bool = False):
    """Execute ``requests`` and wait for every final response. ``all_queued``: the scheduler takes
    none before the last is queued (execute() enqueues one by one, re-entering the model's lock,
    an RLock, that the scheduler needs to admit), so the admission order does not depend on timing."""
    if all_queued:
        with model.cond:
            assert model.execute(list(requests)) is None
    else:
        assert model.execute(list(requests)) is None
    model.drain(timeout=120)
    assert not model.inflight
    return requests


# --- batching -----------------------------------------------------------------------------------


def test_batched_sequences_at_different_positions_match_one_at_a_time(masked):
    model, onnx_path = masked
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 1], [2, 2], [3, 1, 4, 1, 5], [9, 8]]
    first = ids_request(prompts[0], 12, ignore_eos=np.array([True]))
    # The scheduler stops after the first request's 4th token (it is now at another position) while
    # the rest are queued, all at once: the batches below do not depend on thread timing.
    recorder = Recorder(model, pause_when=lambda: len(first.sent) >= 4)
    model.execute([first])
    assert recorder.paused.wait(60), "the first request never reached its 4th token"
    rest = [ids_request(p, 10, ignore_eos=np.array([True])) for p in prompts[1:]]
    with model.cond:
        assert model.execute(rest) is None
    recorder.resume()
    model.drain(timeout=120)
    assert not model.inflight
    for prompt, request in zip(prompts, [first, *rest]):
        assert tokens(request) == reference_generate_all(onnx_path, prompt, len(tokens(request)))
        assert len(tokens(request)) == (12 if request is first else 10)
    sizes = [ids.shape[0] for ids, _ in recorder.calls]
    assert max(sizes) == 4  # max_batch_size bounds the batch; batches did form
    histogram = model.stats()["executions_by_batch_size"]
    assert {int(b) for b in histogram} == set(sizes) and sum(histogram.values()) == len(sizes)
    padded = [mask for _, mask in recorder.calls if (mask == 0).any()]
    assert padded  # sequences at different positions shared steps, with padding


def reference_generate_all(onnx_path: Path, prompt: list[int], count: int) -> list[int]:
    """Greedy batch-1 decode of ``count`` tokens, EOS ignored."""
    sess = ort_session(onnx_path)
    past = {f"past_key_values.{i}.{k}": np.zeros((1, HEADS, 0, HEAD_DIM), np.float32)
            for i in range(LAYERS) for k in ("key", "value")}
    step, total, out = prompt, len(prompt), []
    while len(out) < count:
        feeds = {"input_ids": np.array([step], np.int64), "attention_mask": np.ones((1, total), np.int64), **past}
        logits, *present = sess.run(None, feeds)
        out.append(int(logits[0, -1].argmax()))
        past, step, total = dict(zip(past, present)), [out[-1]], total + 1
    return out


def test_padding_is_on_the_left_of_the_past_with_a_zero_mask(masked):
    model, _ = masked
    package = type(model).__module__.rpartition(".")[0]  # the served/ package as the entry loaded it
    seq_cls = sys.modules[f"{package}.sequence"].Sequence
    seqs = []
    for length, pending in ((2, [7]), (5, [3]), (0, [4])):
        seq = seq_cls(None, None, [1] * max(length, 1), 4, set(), None, [], None)
        seq.kv = model._allocate(seq)
        for j, kv in enumerate(seq.kv):
            kv[:, :length] = j + 1 + np.arange(length)[None, :, None]
        seq.length, seq.pending = length, pending
        seqs.append(seq)
    feeds = model.feeds(seqs, 1)
    assert feeds["input_ids"].tolist() == [[7], [3], [4]]
    assert feeds["attention_mask"].tolist() == [[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]]
    key = feeds["past_key_values.0.key"]  # [3, H, 5, D]
    assert key.shape == (3, HEADS, 5, HEAD_DIM)
    assert key[0, 0, :, 0].tolist() == [0, 0, 0, 1, 2] and key[1, 0, :, 0].tolist() == [1, 2, 3, 4, 5]
    assert not key[2].any()


def test_the_masked_graph_needs_the_right_mask():
    """Sanity of this file's graph: a left-padded past with the right mask gives the unpadded
    logits; an all-ones mask over the same padding does not."""
    path = masked_llm(Path(__import__("tempfile").mkdtemp()) / "m.onnx")
    sess = ort_session(path)
    prefill = {"input_ids": np.array([[1, 2, 3]], np.int64), "attention_mask": np.ones((1, 3), np.int64),
               **{f"past_key_values.{i}.{k}": np.zeros((1, HEADS, 0, HEAD_DIM), np.float32)
                  for i in range(LAYERS) for k in ("key", "value")}}
    _, *present = sess.run(None, prefill)
    names = list(prefill)[2:]
    step = {"input_ids": np.array([[4]], np.int64), "attention_mask": np.ones((1, 4), np.int64), **dict(zip(names, present))}
    pad = {n: np.concatenate([np.zeros((1, HEADS, 2, HEAD_DIM), np.float32), a], axis=2) for n, a in zip(names, present)}
    right = {"input_ids": step["input_ids"], "attention_mask": np.array([[0, 0, 1, 1, 1, 1]]), **pad}
    wrong = {**right, "attention_mask": np.ones((1, 6), np.int64)}
    expected = sess.run(["logits"], step)[0]
    np.testing.assert_allclose(sess.run(["logits"], right)[0], expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(sess.run(["logits"], wrong)[0], expected, atol=1e-3)


def test_long_prompts_are_prefilled_in_chunks(masked):
    model, onnx_path = masked
    recorder = Recorder(model)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 2 + [1, 2]  # 22 tokens > the profile's 16
    request, = run(model, ids_request(prompt, 5, ignore_eos=np.array([True])))
    assert tokens(request) == reference_generate_all(onnx_path, prompt, 5)
    assert [ids.shape for ids, _ in recorder.calls][:3] == [(1, 16), (1, 6), (1, 1)]
    assert recorder.calls[1][1].shape == (1, 22)  # past 16 + 6 new


def test_queued_requests_all_complete_once_and_the_kv_budget_bounds_the_batch(tmp_path, monkeypatch):
    budget_tokens = 2 * 12  # two sequences of prompt 2 + max_tokens 10
    repo = repository(tmp_path, kv_cache_budget_mib=budget_tokens * 2 * LAYERS * HEADS * HEAD_DIM * 4 / 2**20)
    fake_backend(monkeypatch, ort_session(tmp_path / "work" / "masked.onnx"))
    model = load_template(repo / "tiny_generate")
    recorder = Recorder(model)
    requests = [ids_request([1 + i % 9, 2], 10, ignore_eos=np.array([True])) for i in range(12)]
    too_big = ids_request([1] * 20, 13)
    run(model, *requests, too_big)
    for i, request in enumerate(requests):
        assert tokens(request) == reference_generate_all(tmp_path / "work" / "masked.onnx", [1 + i % 9, 2], 10)
        assert [f for _, f in request.sent] == [0] * 9 + [1] and final(request)["finish_reason"] == "length"
    assert max(ids.shape[0] for ids, _ in recorder.calls) == 2
    assert model.stats()["kv_cache_budget_tokens"] == budget_tokens
    assert "holds 24 tokens" in too_big.sent[0][0].error
    model.finalize()


def test_a_cancelled_request_frees_its_slot_for_a_queued_one(masked):
    model, _ = masked
    recorder = Recorder(model)
    long = [ids_request([1 + i], 30, ignore_eos=np.array([True])) for i in range(3)]
    cancelled = ids_request([9], 30, cls=CancellingRequest, after=5, ignore_eos=np.array([True]))
    queued = ids_request([5, 5, 5], 2, ignore_eos=np.array([True]))
    asked = cancelled.is_cancelled

    def once_queued() -> bool:  # cancel only while `queued` waits for a slot
        return asked() and any(s.request is queued for s in list(model.waiting))

    cancelled.is_cancelled = once_queued
    run(model, *long, cancelled, queued, all_queued=True)
    assert final(queued) == {"finish_reason": "length", "detail": "max_tokens 2 reached"}
    assert cancelled.sent[-1][0].error.code == "CANCELLED" and 1 <= len(tokens(cancelled)) < 30
    gone = max(i for i, step in enumerate(recorder.steps) if cancelled in step)
    joined = next(i for i, step in enumerate(recorder.steps) if queued in step)
    assert gone < joined <= gone + 2  # admitted in the next step (prefill and decode steps alternate)
    assert all(len(tokens(r)) == 30 for r in long)


class FlagRequest(FakeRequest):
    """A request whose client disconnects when the test sets ``gone``."""

    gone = False

    def is_cancelled(self) -> bool:
        return self.gone


def test_a_disconnect_during_a_step_frees_the_slot_before_the_next_step(masked):
    model, _ = masked  # max_batch_size 4
    long = [ids_request([1 + i], 30, ignore_eos=np.array([True])) for i in range(3)]
    victim = ids_request([9], 30, cls=FlagRequest, ignore_eos=np.array([True]))
    queued = ids_request([5], 3, ignore_eos=np.array([True]))
    steps, forward, left_at = [], model._forward, []

    def spy(seqs, n):  # each step: its batch and the active sequences; the client leaves during a decode step
        batch = [s.request for s in seqs]
        steps.append((batch, [s.request for s in model.active]))
        waits = any(s.request is queued for s in list(model.waiting))
        if victim in batch and len(tokens(victim)) >= 3 and not victim.gone and waits:
            victim.gone = True
            left_at.append((len(steps) - 1, len(tokens(victim))))
        return forward(seqs, n)

    model._forward = spy
    run(model, *long, victim, queued, all_queued=True)
    k, produced = left_at[0]
    assert queued not in steps[k][1] and len(steps[k][1]) == 4  # the batch was full: the queued request waited
    batch, active = steps[k + 1]  # the next step: the victim has left and the queued request took its slot
    assert victim not in active and queued in active and len(active) == 4
    assert all(victim not in b for b, _ in steps[k + 1:])
    assert victim.sent[-1][0].error.code == "CANCELLED" and len(tokens(victim)) == produced + 1  # step k's token
    assert final(queued)["finish_reason"] == "length" and all(len(tokens(r)) == 30 for r in long)


def test_a_failing_request_does_not_stop_the_others(masked):
    model, onnx_path = masked
    Recorder(model, poison=[7, 7])
    good = [ids_request([1, 2], 6, ignore_eos=np.array([True])), ids_request([3], 6, ignore_eos=np.array([True]))]
    bad = ids_request([7, 7], 6)
    run(model, good[0], bad, good[1])
    assert "poisoned prompt [7, 7]" in bad.sent[-1][0].error and len(bad.sent) == 1
    for request, prompt in zip(good, ([1, 2], [3])):
        assert tokens(request) == reference_generate_all(onnx_path, prompt, 6)
    again, = run(model, ids_request([4], 3, ignore_eos=np.array([True])))
    assert tokens(again) == reference_generate_all(onnx_path, [4], 3)


def test_continuous_batching_off_decodes_each_request_alone(tmp_path, monkeypatch):
    repo = repository(tmp_path, continuous_batching=False)
    fake_backend(monkeypatch, ort_session(tmp_path / "work" / "masked.onnx"))
    model = load_template(repo / "tiny_generate")
    requests = run(model, *[ids_request([1 + i, 3], 5, ignore_eos=np.array([True])) for i in range(4)])
    for i, request in enumerate(requests):
        assert tokens(request) == reference_generate_all(tmp_path / "work" / "masked.onnx", [1 + i, 3], 5)
    assert model.stats()["executions_by_batch_size"] == {"1": 20} and not model.stats()["continuous_batching"]
    model.finalize()


def test_python_onnxruntime_target_runs_the_compute_graph_in_process(tmp_path, monkeypatch):
    qdq = tiny_llm(tmp_path / "work" / "qdq.onnx", qdq=True)
    repo = repository(tmp_path, onnx_path=qdq, target="python-onnxruntime")
    fake_backend(monkeypatch, None)  # BLS would fail: no compute session behind it
    model = load_template(repo / "tiny_generate")
    assert type(model.compute).__name__ == "InProcessCompute" and model.compute.weights  # FP8 weights dequantized
    requests = run(model, ids_request([1, 2, 3], 5), ids_request([4], 5))
    for request, prompt in zip(requests, ([1, 2, 3], [4])):
        assert tokens(request) == reference_generate(qdq, prompt, 5)
    model.finalize()


def test_scheduler_stats_request_returns_the_histogram(masked):
    model, _ = masked
    run(model, ids_request([1], 3, ignore_eos=np.array([True])))
    stats, = run(model, FakeRequest(scheduler_stats=np.array([True])))
    (response, flags), = stats.sent
    data = json.loads(response.outputs["text_output"][0].decode())
    assert flags == 1 and response.outputs["finish_reason"][0] == b"stats"
    assert data["executions_by_batch_size"] == {"1": 3} and data["max_batch"] == 4 and data["mean_batch"] == 1.0


# --- sampling -------------------------------------------------------------------------------------


def sample_request(seed=None, **options):
    arrays = {"temperature": np.array([options.pop("temperature", 1.0)], np.float32)}
    if seed is not None:
        arrays["seed"] = np.array([seed], np.int64)
    for name, dtype in (("top_k", np.int32), ("top_p", np.float32)):
        if name in options:
            arrays[name] = np.array([options.pop(name)], dtype)
    return ids_request([1, 2], 12, ignore_eos=np.array([True]), **arrays, **options)


def test_a_fixed_seed_reproduces_the_tokens_and_top_k_1_is_greedy(masked):
    model, onnx_path = masked
    a, = run(model, sample_request(seed=11, temperature=2.0))
    b, = run(model, sample_request(seed=11, temperature=2.0))
    c, = run(model, sample_request(seed=12, temperature=2.0))
    assert tokens(a) == tokens(b) and tokens(a) != tokens(c)
    greedy = reference_generate_all(onnx_path, [1, 2], 12)
    assert tokens(a) != greedy
    k1, = run(model, sample_request(seed=3, temperature=5.0, top_k=1))
    p0, = run(model, sample_request(seed=3, temperature=5.0, top_p=1e-6))
    assert tokens(k1) == greedy and tokens(p0) == greedy


def test_sampling_keeps_to_top_k_and_top_p():
    logits = np.log(np.array([0.05, 0.5, 0.3, 0.15], np.float32))
    top2 = decoding.Sampling(1.0, top_k=2, seed=0)
    assert {top2.pick(logits) for _ in range(300)} == {1, 2}
    nucleus = decoding.Sampling(1.0, top_p=0.85, seed=0)  # 0.5 + 0.3 < 0.85 <= 0.5 + 0.3 + 0.15
    assert {nucleus.pick(logits) for _ in range(300)} == {1, 2, 3}
    draws = [decoding.Sampling(1.0, seed=5).pick(logits) for _ in range(3)]
    assert len(set(draws)) == 1


@pytest.mark.parametrize("name,value,message", [
    ("temperature", np.array([-1.0], np.float32), "temperature must be a finite number >= 0 (0 = greedy); got -1.0"),
    ("top_k", np.array([-2], np.int32), "top_k must be an integer >= 0 (0 = off); got -2"),
    ("top_p", np.array([0.0], np.float32), "top_p must be in (0, 1] (1 = off); got 0.0"),
    ("seed", np.array([1.5], np.float32), "seed must be one integer >= 0 (INT64 [1]); got [1.5] of type float32"),
    ("stop", np.array([b"x", b""], np.object_), "stop must be a list of non-empty strings (STRING [k]); got ['x', '']"),
])
def test_bad_sampling_values_are_refused_naming_the_input(masked, name, value, message):
    model, _ = masked
    request, = run(model, ids_request([1], 3, **{name: value}))
    (response, flags), = request.sent
    assert flags == 1 and response.error == message


# --- stop strings -------------------------------------------------------------------------------------


def test_stop_strings_hold_back_a_possible_start_and_cut_at_the_stop():
    stopper = decoding.StopStrings(["cd", "xyz"])
    assert stopper.add("ab") == ("ab", None)
    assert stopper.add("c") == ("", None)  # may begin "cd"
    assert stopper.add("e x") == ("ce ", None)  # "x" may begin "xyz"
    assert stopper.add("y") == ("", None)
    assert stopper.add("zq") == ("", "xyz")  # "xy" was held back: nothing of the stop string was sent
    assert decoding.StopStrings([]).add("abc") == ("abc", None)


def test_a_stop_string_ends_the_stream_with_the_text_before_it(masked):
    model, onnx_path = masked
    tok = Tokenizer.from_file(str(model.tokenizer_file))
    greedy = reference_generate_all(onnx_path, [1, 2], 8)
    words = [tok.decode([t]) for t in greedy]
    stop = next(w for w in words[2:] if w)
    at = words.index(stop)  # the first token whose text is the stop string
    full = continuation(tok, [1, 2], greedy[:at + 1])
    request, = run(model, ids_request([1, 2], 8, ignore_eos=np.array([True]), stop=np.array([stop.encode()], np.object_)))
    assert tokens(request) == greedy[:at + 1]
    assert final(request) == {"finish_reason": "stop", "detail": f"stop string {stop!r}"}
    text = "".join(r.outputs["text_output"][0].decode() for r, _ in request.sent)
    assert text == full[:full.index(stop)]


# --- chat template -------------------------------------------------------------------------------------


def test_messages_are_rendered_with_the_chat_template(masked):
    model, onnx_path = masked
    tok = Tokenizer.from_file(str(model.tokenizer_file))
    messages = [{"role": "b", "content": "c d"}, {"role": "e", "content": "f"}]
    rendered = "b: c d <eos> e: f <eos> j"
    assert model.chat_template == CHAT_TEMPLATE
    ids = tok.encode(rendered, add_special_tokens=False).ids
    chat, raw = run(model, FakeRequest(messages=np.array([json.dumps(messages).encode()], np.object_),
                                       max_tokens=np.array([4], np.int32), ignore_eos=np.array([True])),
                    FakeRequest(text_input=np.array([rendered.encode()], np.object_),
                                max_tokens=np.array([4], np.int32), ignore_eos=np.array([True])))
    assert tokens(chat) == tokens(raw) == reference_generate_all(onnx_path, ids, 4)
    bad, = run(model, FakeRequest(messages=np.array([b'[{"role": "user"}]'], np.object_)))
    assert "messages must be a non-empty JSON list of objects with string 'role' and 'content'" in bad.sent[0][0].error


def test_the_repository_copies_the_chat_template_and_refuses_messages_without_one(tmp_path, monkeypatch):
    repo = repository(tmp_path, chat=False)
    assert not (repo / "tiny_generate" / "1" / "chat_template.jinja").exists()
    fake_backend(monkeypatch, ort_session(tmp_path / "work" / "masked.onnx"))
    model = load_template(repo / "tiny_generate")
    request, = run(model, FakeRequest(messages=np.array([b'[{"role": "user", "content": "a"}]'], np.object_)))
    assert request.sent[0][0].error.startswith("messages: this model's tokenizer has no chat template")
    model.finalize()
    (tmp_path / "work" / "tokenizer" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    repo = repository(tmp_path)
    assert (repo / "tiny_generate" / "1" / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_chat_rendering_matches_transformers_apply_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from pipeline.sources.model import package_file
    from pipeline.recipe.load import load_recipe

    gguf = package_file(load_recipe(Path(__file__).resolve().parents[3] / "recipes" / "fp8-llm.yaml").model)
    folder = tmp_path / "smollm2_tokenizer"  # as the export stage saves it
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True).save_pretrained(folder)
    template = chat.load_chat_template(str(folder))
    assert template is not None
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for messages in ([{"role": "user", "content": "What is 2+2? Say ünïcode."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]):
        text = chat.render_chat(template, messages, chat.special_tokens(str(folder)))
        assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        expected = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert fast.encode(text, add_special_tokens=False).ids == list(expected)


def test_a_stable_batch_feeds_the_last_present_back_without_a_gather(masked):
    model, onnx_path = masked
    gathers = []
    feeds = model.feeds
    model.feeds = lambda seqs, n: gathers.append(len(seqs)) or feeds(seqs, n)
    request, = run(model, ids_request([1, 2, 3], 10, ignore_eos=np.array([True])))
    assert tokens(request) == reference_generate_all(onnx_path, [1, 2, 3], 10)
    assert gathers == [1]  # the prefill; the 9 decode steps reuse the previous step's tensors


@pytest.mark.parametrize("target", ["onnxruntime", "python-onnxruntime"])
def test_steps_request_last_logits_where_the_graph_has_them(tmp_path, monkeypatch, target):
    path = masked_llm(tmp_path / "work" / "last.onnx", last_logits=True)
    repo = repository(tmp_path, onnx_path=path, target=target)
    params = parse_config((repo / "tiny_generate" / "config.pbtxt").read_text()).parameters
    assert params["logits_output"].string_value == "last_logits"
    fake_backend(monkeypatch, ort_session(path))
    model = load_template(repo / "tiny_generate")
    assert model.compute.output_names[0] == "last_logits"
    requests = run(model, ids_request([1, 2, 3], 6, ignore_eos=np.array([True])),
                   ids_request([4], 6, ignore_eos=np.array([True])))
    for request, prompt in zip(requests, ([1, 2, 3], [4])):
        assert tokens(request) == reference_generate_all(path, prompt, 6)
    model.finalize()


# --- in-process compute: reused output buffers ------------------------------------------------------


class OutputWatch:
    """Wraps an InProcessCompute: records, per call, the present outputs' memory (on the calling thread)."""

    def __init__(self, model):
        self.inner, self.presents = model.compute, []
        model.compute = self

    def __call__(self, feeds):
        outputs = self.inner(feeds)
        self.presents.append(outputs[1:])
        return outputs

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_in_process_outputs_reuse_two_buffer_sets_and_keep_the_tokens(tmp_path, monkeypatch):
    repo = repository(tmp_path, target="python-onnxruntime")
    onnx_path = tmp_path / "work" / "masked.onnx"
    fake_backend(monkeypatch, None)
    model = load_template(repo / "tiny_generate")
    assert type(model.compute).__name__ == "InProcessCompute"
    watch = OutputWatch(model)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 1], [2, 2]]
    first = ids_request(prompts[0], 20, ignore_eos=np.array([True]))
    model.execute([first])
    wait_for(lambda: len(first.sent) >= 5, "the first request's 5th token")  # the others join at other positions
    rest = run(model, *[ids_request(p, 12, ignore_eos=np.array([True])) for p in prompts[1:]])
    model.drain(timeout=120)
    for prompt, request in zip(prompts, [first, *rest]):
        assert tokens(request) == reference_generate_all(onnx_path, prompt, len(tokens(request)))
    # One call's outputs never share memory with the next call's (which may read them as its past) ...
    for a, b in zip(watch.presents, watch.presents[1:]):
        assert not np.shares_memory(a[0], b[0])
    # ... and the memory is reused: two sets (large enough here never to grow), not fresh arrays every step.
    bases = {p[0].__array_interface__["data"][0] for p in watch.presents}
    assert len(watch.presents) >= 20 and len(bases) == 2
    model.finalize()


def test_in_process_compute_with_batching_off_keeps_each_thread_s_buffers(tmp_path, monkeypatch):
    repo = repository(tmp_path, target="python-onnxruntime", continuous_batching=False)
    onnx_path = tmp_path / "work" / "masked.onnx"
    fake_backend(monkeypatch, None)
    model = load_template(repo / "tiny_generate")
    prompts = [[1 + i, 3, 2 + i] for i in range(4)]
    requests = run(model, *[ids_request(p, 15, ignore_eos=np.array([True])) for p in prompts])
    for prompt, request in zip(prompts, requests):  # 4 threads at once, each with its own output buffers
        assert tokens(request) == reference_generate_all(onnx_path, prompt, 15)
    assert model.stats()["executions_by_batch_size"] == {"1": 60}
    model.finalize()


def scored(request) -> tuple[list[float], list[int], list[float]]:
    """(prompt logprobs after the first token, generated tokens, their logprobs) of a finished request."""
    scores = [json.loads(r.outputs["scores"][0]) for r, _ in request.sent]
    return scores[0]["prompt"]["logprobs"][1:], tokens(request), [s["token"]["logprob"] for s in scores]


@pytest.mark.parametrize("graph", ["tiny", "masked"])
def test_scoring_in_a_batch_equals_scoring_alone(tmp_path, monkeypatch, graph):
    """Prompts of different lengths that score their prompt share prefill
    steps (one prompt cut into other chunks than alone, one prefilled beside a left-padded past)
    and get the log-likelihoods, greedy tokens and token logprobs they get alone."""
    path = (tiny_llm(tmp_path / "work" / "tiny.onnx") if graph == "tiny"
            else masked_llm(tmp_path / "work" / "masked.onnx"))
    repo = repository(tmp_path, onnx_path=path)
    fake_backend(monkeypatch, ort_session(path))
    batched_and_alone(load_template(repo / "tiny_generate"),
                      [[(7 * i + 3) % 10 + 1 for i in range(20)], [4, 2, 3, 5, 7, 9, 10], [6, 1, 8]])


def batched_and_alone(model, prompts: list[list[int]], atol: float = 1e-4) -> None:
    """Score ``prompts`` (20, 7 and 3 tokens; 3 generated tokens each, EOS ignored) one at a time,
    then batched: the first two queued together (the 20-token prompt cut at 7 tokens), the third
    arriving after that first step (prefilled beside the first's left-padded 7-token past).
    Asserts the steps were shared and every number equals its alone value within ``atol``;
    finalizes ``model``."""
    def request(prompt):
        return ids_request(prompt, 3, ignore_eos=np.array([True]), prompt_logprobs=np.array([2], np.int32),
                           logprobs=np.array([2], np.int32))

    alone = [scored(run(model, request(p))[0]) for p in prompts]
    steps, forward, late = [], model._forward, request(prompts[2])
    model.score_alone = False  # what is checked: batched steps give the numbers of steps alone

    def spy(seqs, n):  # after the first step the third prompt arrives, while the first is mid-prefill
        steps.append((n, [s.length for s in seqs], [s.scoring for s in seqs]))
        if len(steps) == 1:
            model.execute([late])
        return forward(seqs, n)

    model._forward = spy
    first, second = run(model, request(prompts[0]), request(prompts[1]), all_queued=True)
    model.drain(timeout=120)
    batched = [scored(first), scored(second), scored(late)]
    model.finalize()
    assert steps[0] == (7, [0, 0], [True, True])  # the 20-token prompt cut at 7 tokens, beside the 7-token one
    assert (3, [7, 0], [True, True]) in steps  # a prefill beside a left-padded past (7 positions masked)
    for (lp, toks, gen), (lp_b, toks_b, gen_b) in zip(alone, batched):
        assert toks_b == toks
        np.testing.assert_allclose(lp_b, lp, rtol=0, atol=atol)
        np.testing.assert_allclose(gen_b, gen, rtol=0, atol=atol)


@pytest.mark.parametrize("target", ["onnxruntime", "python-onnxruntime"])
def test_prompt_logprobs_over_prefill_chunks_of_a_last_logits_graph(tmp_path, monkeypatch, target):
    """A 20-token prompt in 16-token chunks, batched with a request that does not score: every
    position's log-softmax equals one whole-prompt pass of the graph's full logits."""
    path = masked_llm(tmp_path / "work" / "last.onnx", last_logits=True)
    repo = repository(tmp_path, onnx_path=path, target=target)
    fake_backend(monkeypatch, ort_session(path))
    model = load_template(repo / "tiny_generate")
    prompt = [(7 * i + 3) % 10 + 1 for i in range(20)]
    scored, plain = run(model, ids_request(prompt, 2, ignore_eos=np.array([True]),
                                           prompt_logprobs=np.array([1], np.int32)),
                        ids_request(prompt[:18], 3, ignore_eos=np.array([True])))
    past = {f"past_key_values.{i}.{k}": np.zeros((1, HEADS, 0, HEAD_DIM), np.float32)
            for i in range(LAYERS) for k in ("key", "value")}
    logits = ort_session(path).run(["logits"], {"input_ids": np.array([prompt], np.int64),
                                                "attention_mask": np.ones((1, 20), np.int64), **past})[0][0]
    x = logits.astype(np.float64)
    ref = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    got = json.loads(scored.sent[0][0].outputs["scores"][0])["prompt"]
    np.testing.assert_allclose(got["logprobs"][1:], [ref[i, prompt[i + 1]] for i in range(19)], rtol=1e-5, atol=1e-5)
    assert [t[0][0] for t in got["top"][1:]] == np.argmax(ref[:-1], axis=-1).tolist()
    assert tokens(scored) == reference_generate_all(path, prompt, 2)  # generation is unchanged
    assert tokens(plain) == reference_generate_all(path, prompt[:18], 3)
    assert "scores" not in plain.sent[0][0].outputs
    model.finalize()


def test_a_chat_request_without_max_tokens_may_fill_the_context(masked):
    """OpenAI's chat default: up to the room left in the context (33 tokens here); a raw prompt
    keeps default_max_tokens (6)."""
    model, onnx_path = masked
    messages = [{"role": "b", "content": "c d"}]
    chat, raw = run(model, FakeRequest(messages=np.array([json.dumps(messages).encode()], np.object_),
                                       ignore_eos=np.array([True])),
                    ids_request([1, 2, 3], ignore_eos=np.array([True])))
    prompt = len(Tokenizer.from_file(str(model.tokenizer_file)).encode("b: c d <eos> j",
                                                                       add_special_tokens=False).ids)
    assert len(tokens(chat)) == 33 - prompt and final(chat)["finish_reason"] == "length"
    assert len(tokens(raw)) == 6
