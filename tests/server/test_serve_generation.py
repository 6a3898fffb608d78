"""The generation model's limits, finish reasons, cancellation and streamed text: the template against a stand-in triton_python_backend_utils (seconds), then one real
tritonserver on the tiny LM with a SentencePiece-style (Metaspace) tokenizer."""
from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from pipeline.models.text_generation.served import chat, decoding
from pipeline.errors import PipelineError
from pipeline.serve.client import ServeClientError, StreamClient, generation_inputs
from pipeline.stages.triton import write_repository
from serve_tiny import context_build, llm_artifacts, llm_recipe, stop_when_idle, tiny_metaspace
from tiny import continuation
from test_repository import FakeRequest, fake_pb_utils, load_template, ort_session, reference_generate

EOS_IDS = (0, 8)  # '<eos>' and '.': the tiny LM greedily says [10, 2, 8] = "t the." after [4]
CONTEXT = 20


class FakeTritonError(str):
    """pb_utils.TritonError: a message and a code."""

    CANCELLED = "CANCELLED"

    def __new__(cls, message, code=None):
        error = super().__new__(cls, message)
        error.code = code
        return error


class CancellingRequest(FakeRequest):
    """A request whose client cancels once the model has asked ``after`` times."""

    def __init__(self, after: int, **arrays):
        super().__init__(**arrays)
        self.after, self.asked = after, 0

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.asked > self.after


def fake_backend(monkeypatch, session=None) -> list[str]:
    """fake_pb_utils plus TritonError codes and a Logger; returns the list info logs go to."""
    pb = fake_pb_utils(monkeypatch, session)
    logged: list[str] = []
    pb.TritonError = FakeTritonError
    pb.Logger = type("Logger", (), {"log_info": staticmethod(logged.append)})
    return logged


def metaspace(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_metaspace(folder, EOS_IDS) / "tokenizer.json"))


# --- IncrementalDecoder ----------------------------------------------------------------------------------


def stream_text(decoder_cls, tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = decoder_cls(tok)
    pieces = [decoder.add(i) for i in ids]
    return pieces + [decoder.flush()]


def test_decoding_ids_one_by_one_drops_metaspace_spaces(tmp_path):
    tok = metaspace(tmp_path)
    ids = tok.encode("the cat sat").ids
    assert tok.decode(ids) == "the cat sat"
    assert "".join(tok.decode([i]) for i in ids) == "thecatsat"  # what streaming each id alone gave


@pytest.mark.parametrize("text", ["the cat sat on the mat.", "the \u20acuro cat", "\u00e9 at.", "tt  at the",
                                  "the\u00e9t \u20ac"])
def test_incremental_decoder_joins_to_the_whole_decode(tmp_path, monkeypatch, text):
    tok = metaspace(tmp_path)
    ids = tok.encode(text).ids
    pieces = stream_text(decoding.IncrementalDecoder, tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert not [p for p in pieces if "\ufffd" in p]  # a character appears whole, once its last byte is in


def test_incremental_decoder_pieces(tmp_path, monkeypatch):
    tok = metaspace(tmp_path)
    pieces = stream_text(decoding.IncrementalDecoder, tok, tok.encode("the cat sat").ids)
    assert pieces == ["the", " c", "at", " s", "at", ""]
    euro = tok.encode("the \u20acuro").ids  # the, \u2581, 3 byte tokens, u, r, o
    assert len(euro) == 8
    assert stream_text(decoding.IncrementalDecoder, tok, euro) == ["the", " ", "", "", "\u20ac", "u", "r", "o", ""]
    cut = tok.encode("the \u20ac").ids[:-1]  # a stream that ends inside a character: flush gives what is there
    assert "".join(stream_text(decoding.IncrementalDecoder, tok, cut)) == tok.decode(cut)
    assert "".join(stream_text(decoding.IncrementalDecoder, tok, [2, 0, 5, 3])) == "the sat"  # special skipped


def test_the_first_generated_token_keeps_its_space_after_the_prompt(tmp_path, monkeypatch):
    """A Metaspace word-initial token decoded alone loses its space; seeded with the prompt's
    last ids the decoder gives what the token adds to the prompt's text."""
    tok = metaspace(tmp_path)
    prompt, reply = tok.encode("the cat").ids, tok.encode("the cat sat on").ids[len(tok.encode("the cat").ids):]
    assert not tok.decode(reply[:1]).startswith(" ")  # "\u2581s" alone: no space
    decoder = decoding.IncrementalDecoder(tok, context=prompt)
    pieces = [decoder.add(i) for i in reply] + [decoder.flush()]
    whole = tok.decode(prompt + reply)
    assert "".join(pieces) == whole[len(tok.decode(prompt)):] == " sat on"
    long_prompt = tok.encode("the cat sat on the mat the cat").ids
    assert len(decoding.IncrementalDecoder(tok, context=long_prompt).ids) == decoding.IncrementalDecoder.CONTEXT


# --- the template with a stand-in backend ----------------------------------------------------------------


@pytest.fixture
def generate_model(tmp_path, monkeypatch):
    """The tiny LM's generation model (Metaspace tokenizer, EOS ids 0 and 8, 20-token context,
    24-token prompts) loaded like the python backend does; BLS runs the Q/DQ graph."""
    artifacts = llm_artifacts(tmp_path, tokenizer_dir=tiny_metaspace(tmp_path / "tok", EOS_IDS),
                              build=context_build(CONTEXT, prompt_max=24))
    recipe = llm_recipe(tmp_path)
    write_repository(recipe, export=artifacts["export"], quantized=artifacts["quantize"], build=artifacts["build"],
                     out_dir=Path(recipe.output_dir))
    logged = fake_backend(monkeypatch, ort_session(artifacts["quantize"].onnx_path))
    model = load_template(Path(recipe.output_dir) / "tiny_generate")
    model.logged = logged
    model.tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    model.onnx_path = artifacts["quantize"].onnx_path
    return model


def run(model, *requests):
    assert model.execute(list(requests)) is None
    model.drain(timeout=60)
    assert not model.inflight
    return requests


def ids_request(ids, max_tokens=None, ignore_eos=False, cls=FakeRequest, **extra):
    arrays = {"input_ids": np.array(ids, np.int64)}
    if max_tokens is not None:
        arrays["max_tokens"] = np.asarray(max_tokens)
    if ignore_eos:
        arrays["ignore_eos"] = np.array([True])
    return cls(**extra, **arrays)


def outputs(request, name):
    return [r.outputs[name][0] for r, _ in request.sent if name in r.outputs]


@pytest.mark.parametrize("value", [np.array([0], np.int32), np.array([-3], np.int32), np.array([1.5], np.float32),
                                   np.array([2, 3], np.int32)])
def test_template_refuses_max_tokens_that_is_not_a_positive_integer(generate_model, value):
    request, = run(generate_model, ids_request([4], value))
    (response, flags), = request.sent
    assert flags == 1
    assert response.error.startswith("max_tokens must be one integer >= 1 (INT32 [1]); got "
                                     f"{value.tolist()} of type {value.dtype}")


def test_template_final_response_says_why_it_stopped(generate_model):
    tok = generate_model.tok
    eos, by_max, by_context = run(
        generate_model,
        ids_request([4]),  # default_max_tokens 6; greedy [10, 2, 8] ends at EOS 8
        ids_request([4], np.array([5], np.int32), ignore_eos=True),
        ids_request([1, 2, 3], ignore_eos=True),  # default 6 tokens
    )
    reference = reference_generate(Path(generate_model.onnx_path), [4], 5)
    cases = [(eos, reference[:3], "stop", "EOS token 8", [4]),
             (by_max, reference, "length", "max_tokens 5 reached", [4]),
             (by_context, reference_generate(Path(generate_model.onnx_path), [1, 2, 3], 6), "length",
              "max_tokens 6 reached", [1, 2, 3])]
    for request, tokens, reason, detail, prompt in cases:
        assert [int(t) for t in outputs(request, "token_ids")] == tokens
        assert [flags for _, flags in request.sent] == [0] * (len(tokens) - 1) + [1]
        assert outputs(request, "finish_reason") == [reason.encode()]  # on the final response only
        assert "finish_reason" in request.sent[-1][0].outputs
        assert outputs(request, "detail") == [detail.encode()]
        assert b"".join(outputs(request, "text_output")).decode() == continuation(tok, prompt, tokens)
    assert continuation(tok, [4], cases[0][1]) == "t the."


def test_template_refuses_only_when_prompt_plus_max_tokens_exceeds_the_context(generate_model):
    alone, over, fits, default = run(
        generate_model, ids_request([4] * CONTEXT), ids_request([1, 2, 3], np.array([CONTEXT - 2], np.int32)),
        ids_request([1, 2, 3], np.array([CONTEXT - 3], np.int32), ignore_eos=True),
        ids_request([1, 2, 3] * 5 + [4] * 2, ignore_eos=True))  # 17 tokens: the default 6 lowered to 3
    assert alone.sent[0][0].error == f"prompt has {CONTEXT} tokens; the context limit is {CONTEXT} tokens " \
                                     "(prompt + max_tokens)"
    assert over.sent[0][0].error == (f"prompt (3 tokens) + max_tokens ({CONTEXT - 2}) = {CONTEXT + 1} tokens exceeds "
                                     f"the context limit of {CONTEXT} tokens; lower max_tokens to at most {CONTEXT - 3}")
    assert len(fits.sent) == CONTEXT - 3 and outputs(fits, "finish_reason") == [b"length"]
    assert outputs(fits, "token_ids") == reference_generate(Path(generate_model.onnx_path), [1, 2, 3], CONTEXT - 3)
    assert len(default.sent) == CONTEXT - 17 and outputs(default, "detail") == [b"max_tokens 3 reached"]


def test_template_ends_a_cancelled_request_with_the_cancelled_error(generate_model):
    request, = run(generate_model, ids_request([1, 2, 3], np.array([10], np.int32), ignore_eos=True,
                                               cls=CancellingRequest, after=3))
    *tokens, (final, flags) = request.sent
    assert len(tokens) == 3 and [f for _, f in tokens] == [0, 0, 0]
    assert flags == 1 and final.error.code == FakeTritonError.CANCELLED
    assert final.error == "request cancelled by the client after 3 generated tokens"
    assert generate_model.logged[-1] == "tiny_generate: request cancelled by the client after 3 generated tokens"


def test_client_refuses_a_max_tokens_that_is_not_an_integer():
    for bad in (1.5, "3", True):
        with pytest.raises(PipelineError, match=r"max_tokens must be an integer >= 1; got"):
            generation_inputs(input_ids=[1], max_tokens=bad)
    assert [i.name() for i in generation_inputs(input_ids=[1], max_tokens=np.int64(2))] == ["input_ids", "max_tokens"]


# --- a real tritonserver -----------------------------------------------------------------------------------

SERVER_CONTEXT = 512
PROMPTS = [[4], [1, 2, 3]]
MAX_BATCH = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One tritonserver for the module: the tiny LM with the Metaspace tokenizer (EOS 0 and 8),
    a 512-token context and the validate stage's greedy tokens for PROMPTS."""
    pytest.importorskip("pytriton")
    from pipeline.serve.prepare import prepare
    from pipeline.serve.run import launch

    ws = tmp_path_factory.mktemp("serve_generation")
    artifacts = llm_artifacts(ws, PROMPTS, tokenizer_dir=tiny_metaspace(ws / "tok", EOS_IDS),
                              build=context_build(SERVER_CONTEXT, batch_max=MAX_BATCH))
    onnx_path = Path(artifacts["quantize"].onnx_path)
    artifacts["validate"].greedy_tokens["fp8"] = [reference_generate(onnx_path, p, 8) for p in PROMPTS]
    served = prepare(llm_recipe(ws, max_batch_size=MAX_BATCH), artifacts, backends=["python"])
    srv = launch(served)
    srv.served, srv.onnx_path = served, onnx_path
    srv.tok = Tokenizer.from_file(str(ws / "tok" / "tokenizer.json"))
    try:
        yield srv
    finally:
        code = stop_when_idle(srv, "tiny_generate")
        assert code == 0, srv.logs()[-3000:]


def raw_stream(url: str, inputs) -> tuple[object, object]:
    """Send ``inputs`` to tiny_generate on a bare tritonclient stream; the first (result, error).
    The stream is closed without a cancel (see StreamClient.close)."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("tiny_generate", inputs, enable_empty_final_response=True)
        return results.get(timeout=120)
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.server
def test_served_max_tokens_must_be_a_positive_integer(server):
    from pipeline.serve.client import tensor

    with StreamClient(server.grpc_url, timeout_s=120) as client:
        for bad in (0, -3):
            message = rf"max_tokens must be one integer >= 1 \(INT32 \[1\]\); got \[{bad}\]"
            with pytest.raises(ServeClientError, match=message):
                client.generate("tiny_generate", input_ids=[4], max_tokens=bad)
        assert client.generate("tiny_generate", input_ids=[4], max_tokens=2).tokens == [10, 2]  # the stream goes on
    result, error = raw_stream(server.grpc_url, [tensor("input_ids", np.array([4], np.int64)),
                                                 tensor("max_tokens", np.array([1.5], np.float32))])
    assert result is None and "max_tokens" in str(error) and "INT32" in str(error)


@pytest.mark.server
def test_served_final_responses_carry_finish_reason_and_metaspace_text(server):
    with StreamClient(server.grpc_url, timeout_s=120) as client:
        eos = client.generate("tiny_generate", input_ids=[4])
        generated = SERVER_CONTEXT - 3  # prompt + max_tokens = the context
        long = client.generate("tiny_generate", input_ids=[1, 2, 3], max_tokens=generated, ignore_eos=True)
        short = client.generate("tiny_generate", input_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
        with pytest.raises(ServeClientError, match=f"exceeds the context limit of {SERVER_CONTEXT} tokens"):
            client.generate("tiny_generate", input_ids=[1, 2, 3], max_tokens=generated + 1)
    assert (eos.tokens, eos.finish_reason, eos.detail, eos.text) == ([10, 2, 8], "stop", "EOS token 8", "t the.")
    assert len(long.tokens) == generated == len(long.times)
    assert long.tokens == reference_generate(server.onnx_path, [1, 2, 3], generated)
    assert (long.finish_reason, long.detail) == ("length", f"max_tokens {generated} reached")
    assert long.text == continuation(server.tok, [1, 2, 3], long.tokens) and " the" in long.text  # spaces kept
    assert (short.tokens, short.finish_reason, short.detail) == (long.tokens[:4], "length", "max_tokens 4 reached")


CANCEL_LINE = "request cancelled by the client after"


def close_after_two_tokens(server, max_tokens: int = 500) -> int | None:
    """One stream closed once 2 tokens have arrived; the tokens the server had generated when
    it saw the cancel (from its log line), or None when the generation ran all ``max_tokens``
    steps first: 500 tokens take the tiny LM about 0.3 s, and a loaded machine can stall the
    client that long between two reads. This module's tests run one at a time, so the
    scheduler's step count is this request's."""
    before = server.logs().count(CANCEL_LINE)
    steps = scheduler_stats(server.grpc_url)["steps"]
    client = StreamClient(server.grpc_url, timeout_s=120)
    try:
        gen = client.start("tiny_generate", input_ids=[1, 2, 3], max_tokens=max_tokens, ignore_eos=True)
        while len(gen.tokens) < 2:
            assert not client.receive(gen)
    finally:
        client.close()
    assert gen.finish_reason == "cancelled" and 2 <= len(gen.tokens) < max_tokens
    deadline = time.monotonic() + 120  # waits for the scheduler and its log line, not speed bounds
    while (stats := scheduler_stats(server.grpc_url))["inflight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stats["inflight"], stats
    if stats["steps"] - steps >= max_tokens:  # a prefill and max_tokens - 1 decode steps: it ran to the end
        return None
    while server.logs().count(CANCEL_LINE) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [x for x in server.logs().splitlines() if CANCEL_LINE in x][before:]
    assert len(lines) == 1 and "tiny_generate: " in lines[0], lines or server.logs()[-2000:]
    return int(lines[0].split("after ")[1].split()[0])


@pytest.mark.server
def test_served_close_cancels_the_request_and_the_server_serves_on(server):
    outcomes = []
    while len(outcomes) < 5 and (not outcomes or outcomes[-1] is None):  # None: it ended before the cancel
        outcomes.append(close_after_two_tokens(server))
    assert outcomes[-1] is not None and 2 <= outcomes[-1] < 500, f"no cancel reached the server: {outcomes}"
    with StreamClient(server.grpc_url, timeout_s=120) as again:
        assert again.generate("tiny_generate", input_ids=[4]).finish_reason == "stop"


@pytest.mark.server
def test_serve_check_passes_on_the_new_final_responses(server):
    from pipeline.serve.check import check_greedy

    checks = check_greedy(server.served, server.grpc_url)
    assert [(c.index, c.ok, c.streamed) for c in checks] == [(0, True, [10, 2, 8]), (1, True, [2, 8])]  # cut at EOS 8
    assert [c.finish for c in checks] == ["stop: EOS token 8"] * 2


def test_check_verdict_says_why_a_short_stream_ended():
    from pipeline.serve.check import PromptCheck

    short = PromptCheck(0, [5], [5, 6],
                        finish="length: context limit 33 tokens reached (prompt 32 tokens, 1 generated)")
    assert short.verdict == ("MISMATCH from position 1: streamed [5] expected [5, 6] (stream ended: length: context "
                             "limit 33 tokens reached (prompt 32 tokens, 1 generated))")


def scheduler_stats(url: str) -> dict:
    """The generation model's scheduler statistics (a ``scheduler_stats`` request)."""
    from pipeline.serve.client import scheduler_statistics

    stats = scheduler_statistics(url, "tiny_generate")
    assert stats is not None
    return stats


@pytest.mark.server
def test_served_64_concurrent_streams_at_max_batch_8_all_complete(server):
    from concurrent.futures import ThreadPoolExecutor

    before = scheduler_stats(server.grpc_url)["executions_by_batch_size"]
    prompts = [[1 + i % 10, 1 + (i * 3) % 10] for i in range(64)]
    counts = [4 + i % 13 for i in range(64)]

    def stream(i):
        with StreamClient(server.grpc_url, timeout_s=300) as client:
            return client.generate("tiny_generate", input_ids=prompts[i], max_tokens=counts[i], ignore_eos=True)

    with ThreadPoolExecutor(64) as pool:
        gens = list(pool.map(stream, range(64)))
    for i, gen in enumerate(gens):
        assert (len(gen.tokens), gen.finish_reason) == (counts[i], "length")  # none lost, none duplicated
        assert gen.tokens == reference_generate(server.onnx_path, prompts[i], counts[i])
    after = scheduler_stats(server.grpc_url)["executions_by_batch_size"]
    grew = {int(b) for b in after if after[b] > before.get(b, 0)}
    # 64 streams share steps, never more than max_batch_size at once (how full a step gets depends on
    # how fast the client threads submit, so the exact maximum is not asserted)
    assert max(grew) >= 2 and all(1 <= b <= MAX_BATCH for b in grew)
    kv_mib = 2 * MAX_BATCH * SERVER_CONTEXT * 2 * 1 * 4 * 4 / 2**20  # 2 x B x S x L x H_kv x D x bytes
    assert (f"tiny_generate: continuous batching on; max batch {MAX_BATCH}; KV cache budget {kv_mib:.2f} MiB = "
            f"2 x B {MAX_BATCH} x S {SERVER_CONTEXT} x L 2 x H_kv 1 x D 4 x 4 bytes") in server.logs()


@pytest.mark.server
def test_served_cancelled_stream_frees_its_slot_for_a_queued_request(server):
    clients = [StreamClient(server.grpc_url, timeout_s=300) for _ in range(MAX_BATCH + 1)]
    try:
        long = [c.start("tiny_generate", input_ids=[1, 2, 3], max_tokens=SERVER_CONTEXT - 3, ignore_eos=True)
                for c in clients[:MAX_BATCH]]
        for client, gen in zip(clients, long):  # all MAX_BATCH slots are streaming
            assert not client.receive(gen)
        queued = clients[-1].start("tiny_generate", input_ids=[4], max_tokens=2, ignore_eos=True)
        clients[0].close()  # frees a slot: the queued request runs while the others still stream
        while not clients[-1].receive(queued):
            pass
        assert queued.tokens == [10, 2] and queued.finish_reason == "length"
        for client, gen in zip(clients[1:MAX_BATCH], long[1:]):
            while not client.receive(gen):
                pass
        # It ended before any other stream did: its slot was the cancelled one's, not one of theirs.
        assert queued.times[-1] < min(gen.times[-1] for gen in long[1:])
        assert all(len(gen.tokens) == SERVER_CONTEXT - 3 for gen in long[1:])
    finally:
        for client in clients:
            client.close()


@pytest.mark.server
def test_serve_check_streams_prompts_concurrently_under_batching(server):
    from pipeline.serve.check import check_greedy, near_tie_summary

    checks = check_greedy(server.served, server.grpc_url, concurrency=2)
    assert [(c.index, c.ok, c.batched, c.streamed) for c in checks] == [(0, True, True, [10, 2, 8]),
                                                                      (1, True, True, [2, 8])]
    assert near_tie_summary(checks) == ("0 of 2 prompts reached a near tie (top-2 logit gap < 0.25) of the batch-1 "
                                        "reference and differed from there")


def test_check_excuses_a_batched_difference_only_after_a_near_tie():
    from pipeline.serve.check import PromptCheck, near_tie_summary

    gaps = [2.0, 1.5, 0.04, 3.0]  # position 2 is a near tie
    flipped = PromptCheck(0, [5, 6, 9, 1], [5, 6, 7, 8], reference=[5, 6, 7, 8], batched=True, gaps=gaps)
    assert flipped.near_tie == 2 and flipped.ok and flipped.tie_excused
    assert flipped.verdict == ("batched: equal to the batch-1 reference up to position 2, a near tie (top-2 logit "
                               "gap 0.0400 < 0.25); the tokens differ from there")
    early = PromptCheck(1, [5, 4, 7, 8], [5, 6, 7, 8], reference=[5, 6, 7, 8], batched=True, gaps=gaps)
    assert not early.ok and early.verdict.startswith("MISMATCH from position 1")
    alone = PromptCheck(2, [5, 6, 9, 1], [5, 6, 7, 8], reference=[5, 6, 7, 8], gaps=gaps)  # concurrency 1: exact
    assert not alone.ok
    assert near_tie_summary([flipped, early, alone]) == (
        "1 of 3 prompts reached a near tie (top-2 logit gap < 0.25) of the batch-1 reference and differed from "
        "there: prompts [0]")


# --- prompt and token logprobs -----------------------------------------------------


def reference_logprobs(onnx_path, ids: list[int]) -> np.ndarray:
    """log-softmax of the graph's logits [len(ids), vocab] for ``ids`` in one prefill (float64)."""
    from test_repository import HEAD_DIM, HEADS, LAYERS, ort_session

    past = {f"past_key_values.{i}.{k}": np.zeros((1, HEADS, 0, HEAD_DIM), np.float32)
            for i in range(LAYERS) for k in ("key", "value")}
    logits = ort_session(onnx_path).run(["logits"], {"input_ids": np.array([ids], np.int64),
                                                     "attention_mask": np.ones((1, len(ids)), np.int64), **past})[0]
    x = logits[0].astype(np.float64)
    return x - (x.max(-1, keepdims=True) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))


def scores(request) -> list[dict]:
    import json

    return [json.loads(v) for v in outputs(request, "scores")]


def test_template_scores_the_prompt_from_the_prefill_logits(tmp_path, monkeypatch, prompt_max=24):
    """One prefill (test_scheduler checks chunked prefills and a last_logits graph)."""
    artifacts = llm_artifacts(tmp_path, tokenizer_dir=tiny_metaspace(tmp_path / "tok", EOS_IDS),
                              build=context_build(CONTEXT, prompt_max=prompt_max))
    recipe = llm_recipe(tmp_path)
    write_repository(recipe, export=artifacts["export"], quantized=artifacts["quantize"], build=artifacts["build"],
                     out_dir=Path(recipe.output_dir))
    fake_backend(monkeypatch, ort_session(artifacts["quantize"].onnx_path))
    model = load_template(Path(recipe.output_dir) / "tiny_generate")
    prompt = [4, 2, 3, 5, 7, 9, 10, 2, 6]
    only, plus_one = run(model, ids_request(prompt, np.array([0], np.int32), prompt_logprobs=np.array([2], np.int32)),
                         ids_request(prompt, np.array([1], np.int32), prompt_logprobs=np.array([3], np.int32),
                                     logprobs=np.array([1], np.int32)))
    ref = reference_logprobs(artifacts["quantize"].onnx_path, prompt)
    expected = [None] + [ref[i, prompt[i + 1]] for i in range(len(prompt) - 1)]
    (response, flags), = only.sent  # max_tokens 0: one final response, no token
    assert flags == 1 and "token_ids" not in response.outputs and outputs(only, "finish_reason") == [b"length"]
    got = scores(only)[0]["prompt"]
    assert got["ids"] == prompt and got["logprobs"][0] is None and got["top"][0] is None
    np.testing.assert_allclose(got["logprobs"][1:], expected[1:], rtol=1e-5, atol=1e-5)
    for i, top in enumerate(got["top"][1:]):
        order = np.argsort(-ref[i], kind="stable")[:2]
        assert [t for t, _ in top] == order.tolist()
        np.testing.assert_allclose([v for _, v in top], ref[i, order], rtol=1e-5, atol=1e-5)
    (first, flags), = plus_one.sent  # max_tokens 1: the prompt's scores and one token, with its logprob
    token = int(first.outputs["token_ids"][0])
    assert flags == 1 and token == int(np.argmax(ref[-1]))
    both = scores(plus_one)[0]
    np.testing.assert_allclose(both["prompt"]["logprobs"][1:], expected[1:], rtol=1e-5, atol=1e-5)
    assert all(len(t) == 3 for t in both["prompt"]["top"][1:])
    assert both["token"]["logprob"] == pytest.approx(ref[-1, token], abs=1e-5)
    assert both["token"]["top"][0][0] == token


def test_template_sends_one_token_even_when_it_is_eos(generate_model):
    # [4, 10, 2] greedily continues with EOS 8 ('.'): max_tokens 1 still sends that token
    request, = run(generate_model, ids_request([4, 10, 2], np.array([1], np.int32),
                                               prompt_logprobs=np.array([0], np.int32)))
    assert [int(t) for t in outputs(request, "token_ids")] == [8]
    assert outputs(request, "finish_reason") == [b"stop"]
    assert scores(request)[0]["prompt"]["top"] == [None, [], []]


def test_template_scoring_refusals(generate_model):
    over, bad_k, zero = run(generate_model,
                            ids_request([4] * (CONTEXT + 1), np.array([0], np.int32),
                                        prompt_logprobs=np.array([1], np.int32)),
                            ids_request([4], np.array([1], np.int32), logprobs=np.array([21], np.int32)),
                            ids_request([4], np.array([0], np.int32)))  # max_tokens 0 without scoring
    assert over.sent[0][0].error == f"prompt has {CONTEXT + 1} tokens; the context limit is {CONTEXT} tokens"
    assert bad_k.sent[0][0].error == "logprobs must be one integer in [0, 20] (the top count); got 21"
    assert zero.sent[0][0].error.startswith("max_tokens must be one integer >= 1")
    full, = run(generate_model, ids_request([4] * CONTEXT, np.array([0], np.int32),
                                            prompt_logprobs=np.array([0], np.int32)))
    assert len(scores(full)[0]["prompt"]["logprobs"]) == CONTEXT  # the whole context can be scored


# --- chat templates ----------------------------------------------------------------

GENERATION_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}"
                       "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_template_renders_generation_blocks_as_transformers_does(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    folder = tiny_metaspace(tmp_path / "tok", EOS_IDS)
    (folder / "chat_template.jinja").write_text(GENERATION_TEMPLATE)
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"},
                {"role": "user", "content": "the mat"}]
    ours = chat.render_chat(chat.load_chat_template(str(folder)), messages, chat.special_tokens(str(folder)))
    theirs = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, tokenize=False,
                                                                             add_generation_prompt=True)
    assert ours == theirs == "<user>the cat<assistant>sat on<user>the mat<assistant>"  # trim_blocks


@pytest.mark.parametrize("template,error", [("{% for m in messages %}{{ m.content }}{% endfor %}", None),
                                            (GENERATION_TEMPLATE, None),
                                            ("{% for m in messages %}{% unknowntag %}{% endfor %}", "unknowntag"),
                                            ("{{ raise_exception('no chat here') }}", "no chat here")])
def test_triton_stage_renders_the_chat_template_once_and_refuses_one_that_cannot(tmp_path, template, error):
    from pipeline.errors import TritonConfigError

    folder = tiny_metaspace(tmp_path / "tok", EOS_IDS)
    (folder / "chat_template.jinja").write_text(template)
    artifacts = llm_artifacts(tmp_path, tokenizer_dir=folder, build=context_build(CONTEXT))
    recipe = llm_recipe(tmp_path)
    build = lambda: write_repository(recipe, export=artifacts["export"], quantized=artifacts["quantize"],  # noqa: E731
                                     build=artifacts["build"], out_dir=Path(recipe.output_dir))
    if error is None:
        build()
        assert (Path(recipe.output_dir) / "tiny_generate" / "1" / "chat_template.jinja").is_file()
        return
    with pytest.raises(TritonConfigError, match=f"the chat template does not render a sample conversation.*{error}") \
            as err:
        build()
    assert err.value.exit_code == 2


def test_template_stop_string_that_is_a_special_token_matches(tmp_path, monkeypatch):
    """'.' (id 8) made a special token: decoded text leaves it out, so before the fix a stop
    string '.' never matched and the generation ran on to max_tokens."""
    folder = tiny_metaspace(tmp_path / "tok", EOS_IDS)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(["."])
    tok.save(str(folder / "tokenizer.json"))
    assert tok.token_to_id(".") == 8 and tok.decode([10, 2, 8]) == "t the"
    artifacts = llm_artifacts(tmp_path, tokenizer_dir=folder, build=context_build(CONTEXT, prompt_max=24))
    recipe = llm_recipe(tmp_path)
    write_repository(recipe, export=artifacts["export"], quantized=artifacts["quantize"], build=artifacts["build"],
                     out_dir=Path(recipe.output_dir))
    fake_backend(monkeypatch, ort_session(artifacts["quantize"].onnx_path))
    model = load_template(Path(recipe.output_dir) / "tiny_generate")
    reference = reference_generate(Path(artifacts["quantize"].onnx_path), [4], 6)  # [10, 2, 8, ...]: '.' third
    assert reference[:3] == [10, 2, 8]
    stop = np.array([b"."], dtype=np.object_)
    stopped, plain = run(model, ids_request([4], np.array([6], np.int32), ignore_eos=True, stop=stop),
                         ids_request([4], np.array([6], np.int32), ignore_eos=True))
    assert [int(t) for t in outputs(stopped, "token_ids")] == [10, 2, 8]
    assert outputs(stopped, "detail") == [b"stop string '.'"]
    assert b"".join(outputs(stopped, "text_output")).decode() == "t the"  # the special token is left out
    assert len(outputs(plain, "token_ids")) == 6  # without the stop: on to max_tokens
    assert "." not in b"".join(outputs(plain, "text_output")).decode()


def _small_tokenizer(folder: Path, words: int) -> Path:
    """test_repository's WordLevel tokenizer over its first ``words`` words (ids 0..words-1;
    '<eos>' is 0), for the tiny LM whose logits cover 11 ids: a padded vocabulary."""
    from tokenizers import models, pre_tokenizers

    from test_repository import WORDS

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS[:words])}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


def test_the_generation_model_never_samples_or_lists_ids_past_the_tokenizer(tmp_path, monkeypatch):
    """A vocabulary padded past the tokenizer: the tiny LM's logits cover ids
    0..10, its tokenizer has ids 0..5. Greedy, sampled and logprobs answers hold only ids 0..5
    (the raw graph's greedy pick after the prompt is past them)."""
    known = 6
    artifacts = llm_artifacts(tmp_path, tokenizer_dir=_small_tokenizer(tmp_path / "tok", known),
                              build=context_build(40, prompt_max=24))
    recipe = llm_recipe(tmp_path)
    write_repository(recipe, export=artifacts["export"], quantized=artifacts["quantize"], build=artifacts["build"],
                     out_dir=Path(recipe.output_dir))
    graph = Path(artifacts["quantize"].onnx_path)
    prompt = next([p] for p in range(1, known) if reference_generate(graph, [p], 1)[0] >= known)
    fake_backend(monkeypatch, ort_session(graph))
    model = load_template(Path(recipe.output_dir) / "tiny_generate")
    greedy, sampled = run(
        model,
        ids_request(prompt, np.array([8], np.int32), ignore_eos=True, logprobs=np.array([5], np.int32),
                    prompt_logprobs=np.array([5], np.int32)),
        ids_request(prompt, np.array([30], np.int32), ignore_eos=True, temperature=np.array([20.0], np.float32),
                    seed=np.array([1], np.int64)))
    for request in (greedy, sampled):
        tokens = [int(t) for t in outputs(request, "token_ids")]
        assert tokens and max(tokens) < known, tokens
    for score in scores(greedy):
        assert len(score["token"]["top"]) == 5 and all(i < known for i, _ in score["token"]["top"]), score
        assert np.isfinite(score["token"]["logprob"])
    assert all(i < known for i, _ in scores(greedy)[0]["prompt"]["top"][-1] or [])
