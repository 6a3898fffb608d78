"""Our client on AIPerf's HTTP routes, against a local fake server (http.server): the KServe v2 JSON
body AIPerf's template endpoint sends, AIPerf's streamed /v1/completions body, TTFT at the first
content chunk, error answers, and the load threads' niceness and CPU accounting in the closed loop."""
from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from pipeline.serve.bench import closed_loop, lower_thread_priority
from pipeline.serve.client import (
    CompletionsHTTP,
    KServeHTTP,
    ServeClientError,
    completions_body,
    kserve_json_body,
)
from pipeline.serve.crosscheck import body_differences, kserve_template
from pipeline.serve.stats import llm_level

#: What the fake server streams for one /v1/completions request: SSE data lines, in order.
PIECES = ["Once", " upon", "", " a", " time"]


class FakeServer(BaseHTTPRequestHandler):
    """Triton's /v2/models/<m>/infer (model "bad" answers 400) and the endpoint's streamed
    /v1/completions (prompt "error" ends with an error event, "empty" with no text). Every body is
    kept in ``self.server.bodies``."""

    protocol_version = "HTTP/1.1"  # keep-alive, as Triton and uvicorn

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append((self.path, body))
        if self.path.startswith("/v2/models/"):
            model = self.path.split("/")[3]
            if model == "bad":
                return self._send(400, {"error": "unexpected inference input 'txt'"})
            return self._send(200, {"model_name": model, "outputs": [
                {"name": "embedding", "datatype": "FP32", "shape": [1, 2], "data": [0.5, -0.5]}]})
        if self.path == "/v1/completions":
            prompt = body["prompt"][0]
            events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in PIECES]
            if prompt == "error":
                events = events[:1] + [{"error": {"message": "tritonserver went away", "type": "unavailable"}}]
            elif prompt == "empty":
                events = []
            events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data.encode())))
            self.end_headers()
            self.wfile.write(data.encode())
            return None
        return self._send(404, {"error": "no route"})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def fake():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    server.daemon_threads = True
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _text(s: str) -> dict[str, np.ndarray]:
    return {"text": np.array([[s.encode()]], dtype=np.object_)}


def test_our_kserve_body_is_the_one_aiperfs_template_renders():
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment(autoescape=True).from_string(kserve_template("text"))  # as AIPerf 0.5
    for s in ["plain", 'quotes " & <b> \\', "\u00e9\u4e2d\nline"]:
        assert kserve_json_body(_text(s)) == json.loads(template.render(text=s))
    numeric = kserve_json_body({"ids": np.array([[1, 2, 3]], np.int64)})
    assert numeric == {"inputs": [{"name": "ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]}]}


def test_kserve_http_posts_the_json_body_and_an_error_answer_raises(fake):
    url = f"127.0.0.1:{fake.server_address[1]}"
    with KServeHTTP(url) as client:
        assert client.infer_ms("enc_ensemble", _text("a sentence")) >= 0
        with pytest.raises(ServeClientError, match=r"bad: HTTP 400: .*unexpected inference input 'txt'"):
            client.infer_ms("bad", _text("x"))
    assert fake.bodies[0] == ("/v2/models/enc_ensemble/infer", kserve_json_body(_text("a sentence")))


def test_completions_http_sends_aiperfs_body_and_times_content_chunks(fake):
    base = f"http://127.0.0.1:{fake.server_address[1]}/v1"
    with CompletionsHTTP(base, count=lambda text: text.split()) as client:
        g = client.generate("lm", "Hello there", max_tokens=5, ignore_eos=True)
    assert fake.bodies == [("/v1/completions", completions_body("lm", "Hello there", 5, ignore_eos=True))]
    assert fake.bodies[0][1] == {"prompt": ["Hello there"], "model": "lm", "stream": True, "max_tokens": 5,
                                 "ignore_eos": True}
    assert g.text == "Once upon a time" and g.finish_reason == "length"
    assert len(g.times) == 4  # one per event with text; the empty piece and the final event are not tokens
    assert g.sent <= g.times[0] <= g.times[-1] and g.ttft_ms >= 0
    assert g.tokens == ["Once", "upon", "a", "time"]  # the output counted by the tokenizer given


@pytest.mark.parametrize("prompt, why", [("error", "error event: .*tritonserver went away"),
                                         ("empty", "ended without text .*'length'")])
def test_an_error_event_or_a_stream_without_text_raises(fake, prompt, why):
    with CompletionsHTTP(f"http://127.0.0.1:{fake.server_address[1]}/v1") as client:
        with pytest.raises(ServeClientError, match=why):
            client.generate("lm", prompt, max_tokens=5)


def test_an_unreachable_server_is_a_client_error():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with KServeHTTP(f"127.0.0.1:{port}", timeout_s=5) as client:
        with pytest.raises(ServeClientError, match="ConnectError"):
            client.infer_ms("m", _text("x"))


def test_the_closed_loop_drives_the_http_route_with_niced_threads_and_counts_their_cpu(fake):
    """bench's closed loop, unchanged, over CompletionsHTTP: each load thread at its own nice +3
    (this thread untouched), one CPU-time reading per thread, and llm_level on the result."""
    from pipeline.recipe.schema import ServeSLO

    base = f"http://127.0.0.1:{fake.server_address[1]}/v1"
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []

    def work(client, i):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return client.generate("lm", f"prompt {i}", max_tokens=5, ignore_eos=True)

    cpu: list[float] = []
    gens, duration = closed_loop(6, 3, lambda: CompletionsHTTP(base, count=str.split), work, nice=3, cpu_s=cpu)
    assert len(gens) == 6 and sorted(b["prompt"][0] for _, b in fake.bodies) == [f"prompt {i}" for i in range(6)]
    assert set(seen) == {min(here + 3, 19)} and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == here
    assert len(cpu) == 3 and all(c > 0 for c in cpu)
    level = llm_level(gens, duration, ServeSLO(ttft_ms=1e9, tpot_ms=1e9))
    assert level["requests"] == 6 and level["output_tokens_per_s"] == pytest.approx(6 * 4 / duration)


def test_lower_thread_priority_adds_to_the_threads_own_value_only():
    out: dict[str, int] = {}

    def run():
        before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        out["after"] = lower_thread_priority(2)
        out["before"] = before

    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out["after"] == min(out["before"] + 2, 19) and out["before"] == here
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == here


def test_body_differences_names_what_differs_and_can_leave_the_prompt_out():
    ours = [completions_body("lm", "a", 32, ignore_eos=True)]
    same = [completions_body("lm", "other prompt", 32, ignore_eos=True)] * 3
    assert body_differences(same, ours, ignore=("prompt",)) == []
    assert body_differences(same, ours)[0].startswith("request 0: AIPerf")
    other = [{**same[0], "stream_options": {"include_usage": True}}]
    assert "stream_options" in body_differences(other, ours, ignore=("prompt",))[0]


def _runner(served, url: str):
    from types import SimpleNamespace

    from pipeline.serve import tune as T

    server = SimpleNamespace(http_url=url, grpc_url="unused:1", process=SimpleNamespace(poll=lambda: None))
    return T.Runner(served, server, SimpleNamespace(), T.Point(2))


def _serve_cfg():
    from pipeline.recipe.schema import ServeConfig

    return ServeConfig.model_validate({"concurrency": [2], "requests_per_level": 4, "max_tokens": 5,
                                       "slo": {"latency_ms": 60000, "ttft_ms": 60000, "tpot_ms": 60000},
                                       "tune": {"measure_s": 0.05, "min_requests": 4}})


def test_the_runner_drives_an_encoder_on_the_kserve_json_route(fake):
    """tune-serving's measurement, unchanged but for the connection: warm-up, then the load; the
    load threads' CPU time is kept for the cross-check."""
    from types import SimpleNamespace

    feeds = [_text("one"), _text("two")]
    served = SimpleNamespace(generate_model=None, ensemble_model="enc", recipe=SimpleNamespace(serve=_serve_cfg()),
                             artifacts={"export": SimpleNamespace(tokenizer_dir=None)},
                             adapter=SimpleNamespace(bench_workload=lambda r, t: SimpleNamespace(requests=feeds)))
    runner = _runner(served, f"127.0.0.1:{fake.server_address[1]}")
    m = runner.drive(runner.server.http_url, nice=1)
    assert m.ok, m.detail
    assert m.requests >= 4 and len(fake.bodies) == m.requests + 4  # + 2 x concurrency warm-up requests
    assert {path for path, _ in fake.bodies} == {"/v2/models/enc/infer"}
    assert fake.bodies[-m.requests][1] in (kserve_json_body(feeds[0]), kserve_json_body(feeds[1]))
    assert runner.client_cpu_s > 0


def test_the_runner_streams_the_validate_prompts_as_text_through_completions(fake, tmp_path):
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "cat": 2, "sat": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "lm" / "1").mkdir(parents=True)
    tok.save(str(tmp_path / "lm" / "1" / "tokenizer.json"))
    served = SimpleNamespace(generate_model="lm", repository=tmp_path, recipe=SimpleNamespace(serve=_serve_cfg()),
                             artifacts={"validate": SimpleNamespace(greedy_tokens={"prompt_ids": [[1, 2, 3], [2, 3]]})})
    runner = _runner(served, "unused:1")
    m = runner.drive(f"http://127.0.0.1:{fake.server_address[1]}/v1", nice=1)
    assert m.ok, m.detail
    sent = [b for _, b in fake.bodies]
    assert sent[:2] == [completions_body("lm", "the cat sat", 2, ignore_eos=False)] * 2  # warm-up: 2 tokens
    load = sent[2:]
    assert len(load) == m.requests >= 4
    assert {b["prompt"][0] for b in load} == {"the cat sat", "cat sat"}
    assert all(b == completions_body("lm", b["prompt"][0], 5, ignore_eos=True) for b in load)
    assert m.p50_ms >= 0 and m.ttft_p99_ms == m.p99_ms and runner.client_cpu_s > 0
