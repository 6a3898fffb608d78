"""The OpenAI-compatible endpoint (pipeline.serve.openai.app), driven with the official ``openai``
client: one real tritonserver on the tiny LM (Metaspace tokenizer, EOS ids 0 and 8, 16384-token
context) and the endpoint on a free loopback port, both started once for the module."""
from __future__ import annotations

import json
import socket
import time
import types
from pathlib import Path

import anyio
import numpy as np
import pytest
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from tokenizers import Tokenizer

from pipeline.errors import PipelineError
from pipeline.serve.openai.app import ClosingStreamingResponse, is_loopback, resolve_api_key
from pipeline.serve.openai.bridge import StopText, triton_inputs
from pipeline.serve.openai.requests import ApiError, CompletionRequest, parse_request
from pipeline.triton.config import GENERATE_INPUTS
from serve_tiny import context_build, llm_artifacts, llm_recipe, stop_cleanly, tiny_metaspace

openai = pytest.importorskip("openai")

MODEL = "tiny_generate"
EOS_IDS = (0, 8)  # '<eos>' and '.': greedily [4] -> [10, 2, 8] = "t the."
CONTEXT = 16384  # tokens; a whole-context generation takes the tiny LM tens of seconds
HAS_MESSAGES = "messages" in {s.name for s in GENERATE_INPUTS}
#: Chat template of the tiny tokenizer: the messages' contents joined, nothing else.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


# --- without a server ------------------------------------------------------------------------------------


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.8.0.2", True), ("localhost", True),
                                           ("::1", True), ("0.0.0.0", False), ("10.1.2.3", False),
                                           ("::", False), ("example.org", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_api_key_is_required_off_loopback():
    with pytest.raises(PipelineError, match=r"--host 0.0.0.0: .*needs an API key.*PIPELINE_API_KEY") as err:
        resolve_api_key("0.0.0.0", None, environ={})
    assert err.value.exit_code == 2
    assert resolve_api_key("0.0.0.0", "k1", environ={}) == "k1"
    assert resolve_api_key("0.0.0.0", None, environ={"PIPELINE_API_KEY": "k2"}) == "k2"
    assert resolve_api_key("127.0.0.1", None, environ={}) is None  # loopback: optional
    assert resolve_api_key("127.0.0.1", None, environ={"PIPELINE_API_KEY": "k3"}) == "k3"


def test_serve_refuses_to_start_off_loopback_without_a_key(monkeypatch):
    from pipeline.serve import run

    monkeypatch.delenv("PIPELINE_API_KEY", raising=False)
    started = []
    monkeypatch.setattr(run, "launch", lambda served: started.append(served))
    with pytest.raises(PipelineError, match="needs an API key") as err:
        run.serve_forever(types.SimpleNamespace(generate_model="gen"), host="0.0.0.0", log=lambda line: None)
    assert err.value.exit_code == 2 and started == []  # refused before tritonserver starts


def test_serve_on_a_busy_port_fails_before_tritonserver_starts(monkeypatch):
    from pipeline.serve import run

    started = []
    monkeypatch.setattr(run, "launch", lambda served: started.append(served))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PipelineError, match=rf"--openai-port {port}: cannot bind .*--openai-port 0") as err:
            run.serve_forever(types.SimpleNamespace(generate_model="m", note=""), openai_port=port,
                              log=lambda line: None)
    assert err.value.exit_code == 4 and started == []


def test_cli_serve_on_a_busy_port_exits_4_before_any_build(monkeypatch, capsys):
    from conftest import ROOT
    from pipeline.cli import app as cli

    built = []
    monkeypatch.setattr(cli, "_served", lambda *a, **k: built.append(a))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = cli.main(["serve", str(ROOT / "recipes" / "fp8-llm.yaml"), "--openai-port", str(port)])
    assert code == 4 and built == [] and f"--openai-port {port}: cannot bind" in capsys.readouterr().err


def test_the_endpoints_socket_holds_its_port_from_the_start():
    """Bound and listening before tritonserver starts: a second serve on the port fails at once,
    also where it sets SO_REUSEADDR (a bound socket that does not listen would let it in)."""
    from pipeline.errors import EnvironmentFault
    from pipeline.serve.openai.app import bind_socket

    first = bind_socket("127.0.0.1", 0)
    try:
        with pytest.raises(EnvironmentFault, match="cannot bind"):
            bind_socket("127.0.0.1", first.getsockname()[1]).close()
    finally:
        first.close()
    try:
        v6 = bind_socket("[::1]", 0)  # an IPv6 address as written in a URL
    except EnvironmentFault:
        pass  # no IPv6 loopback on this machine
    else:
        assert v6.family == socket.AF_INET6 and v6.getsockname()[0] == "::1"
        v6.close()
    for port in (-1, 65536):
        with pytest.raises(PipelineError, match=rf"--openai-port {port}: a TCP port is 1-65535") as err:
            bind_socket("127.0.0.1", port)
        assert err.value.exit_code == 2


def test_add_serve_arguments_defaults():
    import argparse

    from pipeline.serve.run import DEFAULT_OPENAI_PORT, add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    assert (args.host, args.openai_port, args.api_key) == ("127.0.0.1", DEFAULT_OPENAI_PORT, None)
    args = parser.parse_args(["--host", "0.0.0.0", "--openai-port", "0", "--api-key", "s"])
    assert (args.host, args.openai_port, args.api_key) == ("0.0.0.0", 0, "s")


@pytest.mark.parametrize("body,param", [({"prompt": "a", "max_tokens": 0}, "max_tokens"),
                                        ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
                                        ({"prompt": "a", "temperature": 3}, "temperature"),
                                        ({"prompt": "a", "n": 2}, "n"),
                                        ({"max_tokens": 3}, "prompt"),
                                        # JSON types as sent (strict): no coercion of strings, floats or booleans
                                        ({"prompt": [True, 1]}, "prompt"),
                                        ({"prompt": "a", "max_tokens": "2"}, "max_tokens"),
                                        ({"prompt": "a", "max_tokens": 2.0}, "max_tokens"),
                                        ({"prompt": "a", "echo": "yes"}, "echo")])
def test_bad_fields_are_named(body, param):
    with pytest.raises(ApiError) as err:
        parse_request(CompletionRequest, {"model": MODEL, **body})
    assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(f"{param}: ")


def test_sampling_fields_the_model_lacks_are_refused_unless_default():
    old = {"text_input", "input_ids", "max_tokens", "ignore_eos"}
    greedy = parse_request(CompletionRequest, {"model": MODEL, "prompt": "a", "temperature": 0, "top_p": 1.0,
                                               "stop": "x"})
    assert set(triton_inputs(greedy, old, default_max_tokens=16)) == {"max_tokens"}
    hot = parse_request(CompletionRequest, {"model": MODEL, "prompt": "a", "temperature": 0.7})
    with pytest.raises(ApiError, match="temperature: the served generation model has no 'temperature' input"):
        triton_inputs(hot, old, default_max_tokens=16)
    new = old | {"temperature", "top_p", "top_k", "seed", "stop"}
    full = parse_request(CompletionRequest, {"model": MODEL, "prompt": "a", "temperature": 0.7, "top_p": 0.9,
                                             "top_k": 5, "seed": 3, "stop": ["x", "yz"], "max_tokens": 4})
    sent = triton_inputs(full, new, default_max_tokens=16)
    assert sent["temperature"].dtype == np.float32 and sent["top_k"].tolist() == [5]
    assert sent["seed"].dtype == np.int64 and sent["stop"].tolist() == [b"x", b"yz"]
    assert sent["max_tokens"].tolist() == [4]


def test_stop_text_holds_back_a_possible_stop_string():
    stop = StopText(["END"])
    assert [stop.add(t) for t in ["ab E", "N", "Dzz"]] == ["ab ", "", ""]
    assert stop.stopped and stop.shown == "ab "
    stop = StopText(["END"])
    assert [stop.add(t) for t in ["aE", "Nb"]] == ["a", "ENb"] and stop.flush() == "" and not stop.stopped
    stop = StopText(["xyz"])
    assert stop.add("ax") == "a" and stop.flush() == "x"


def _disconnect_during_send(response_cls, spec_version: str) -> tuple[list, object]:
    """Stream an SSE body whose client goes away while the first chunk is being sent. ASGI 2.3
    (uvicorn): that send hangs and Starlette's disconnect listener cancels it; 2.4: send raises
    OSError. Returns (["closed"] if the body generator's finally ran by the time the response
    returned, the generator)."""
    closed: list[str] = []

    async def body():
        try:
            for k in range(100):
                yield f"data: {k}\n\n"
        finally:
            closed.append("closed")

    gen = body()  # held here, so only an explicit close (not the garbage collector) can close it
    sent, gone = [], anyio.Event()

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body":
            gone.set()
            if spec_version == "2.4":
                raise OSError("client gone")
            await anyio.sleep_forever()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def respond() -> list[str]:
        try:
            await response_cls(gen, media_type="text/event-stream")({"type": "http", "asgi": {
                "spec_version": spec_version}}, receive, send)
        except ClientDisconnect:  # 2.4: Starlette's answer to the OSError
            closed.append("ClientDisconnect")
        return list(closed)  # before the event loop's shutdown closes leftover generators

    return anyio.run(respond), gen


def test_plain_streaming_response_leaves_the_body_open_on_a_disconnect_during_send():
    closed, _gen = _disconnect_during_send(StreamingResponse, "2.3")
    assert closed == []  # why ClosingStreamingResponse exists: the Triton request would run on


@pytest.mark.parametrize("spec_version,expected", [("2.3", ["closed"]), ("2.4", ["closed", "ClientDisconnect"])])
def test_closing_streaming_response_closes_the_body_on_a_disconnect_during_send(spec_version, expected):
    closed, _gen = _disconnect_during_send(ClosingStreamingResponse, spec_version)
    assert closed == expected


# --- a real tritonserver + the endpoint ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """tritonserver on the tiny LM + the endpoint (no key) + one with API key 'sesame'."""
    pytest.importorskip("pytriton")
    from pipeline.serve.prepare import prepare
    from pipeline.serve.run import launch, start_endpoint

    ws = tmp_path_factory.mktemp("openai_api")
    tok_dir = tiny_metaspace(ws / "tok", EOS_IDS)
    (tok_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    artifacts = llm_artifacts(ws, [[4], [1, 2, 3]], tokenizer_dir=tok_dir, build=context_build(CONTEXT))  # room for a long stream
    served = prepare(llm_recipe(ws), artifacts, backends=["python"])
    server = launch(served)
    endpoints = []
    try:
        endpoints.append(start_endpoint(served, server, port=0))
        endpoints.append(start_endpoint(served, server, port=0, api_key="sesame"))
        server.served = served
        server.tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        server.onnx_path = artifacts["quantize"].onnx_path
        server.open = endpoints[0]
        server.locked = endpoints[1]
        server.client = openai.OpenAI(base_url=endpoints[0].url, api_key="unused", max_retries=0, timeout=120)
        yield server
    finally:
        for e in endpoints:
            e.stop()
        stop_cleanly(server, MODEL)  # the tests cancel streams


def greedy(stack, **inputs):
    from pipeline.serve.client import StreamClient

    with StreamClient(stack.grpc_url, timeout_s=120) as c:
        return c.generate(MODEL, **inputs)


@pytest.mark.server
def test_models_lists_the_generation_model(stack):
    models = stack.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


@pytest.mark.server
def test_completion_equals_the_greedy_stream(stack):
    prompt = "the cat sat on"
    reference = greedy(stack, text=prompt, max_tokens=12, ignore_eos=True)
    out = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.token_ids == reference.tokens and len(reference.tokens) == 12
    assert choice.text == reference.text and choice.finish_reason == "length"
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(stack.tok.encode(prompt).ids), 12)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12

    chunks = list(stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == reference.text and len(texts) > 2  # streamed piece by piece
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


@pytest.mark.server
def test_finish_reason_stop_and_length(stack):
    eos = stack.client.completions.create(model=MODEL, prompt=[4], max_tokens=50)
    assert (eos.choices[0].text, eos.choices[0].finish_reason, eos.usage.completion_tokens) == ("t the.", "stop", 3)
    cut = stack.client.completions.create(model=MODEL, prompt=[4], max_tokens=2)
    assert (cut.choices[0].text, cut.choices[0].finish_reason, cut.usage.prompt_tokens) == ("t the", "length", 1)
    stop = stack.client.completions.create(model=MODEL, prompt=[4], max_tokens=50, stop=["he"])
    assert (stop.choices[0].text, stop.choices[0].finish_reason) == ("t t", "stop")
    streamed = list(stack.client.completions.create(model=MODEL, prompt=[4], max_tokens=50, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "t the." and streamed[-1].choices[0].finish_reason == "stop"


@pytest.mark.server
def test_bad_max_tokens_is_a_400_naming_the_field(stack):
    for bad in (0, -1, 2.5):
        with pytest.raises(openai.BadRequestError) as err:
            stack.client.completions.create(model=MODEL, prompt="the", max_tokens=bad)
        assert err.value.status_code == 400
        error = err.value.body
        assert error["param"] == "max_tokens" and "max_tokens" in error["message"]
        assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:  # prompt + max_tokens above the context
        stack.client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=CONTEXT)
    assert err.value.body["param"] == "max_tokens"
    assert f"exceeds the context limit of {CONTEXT} tokens; lower max_tokens to at most {CONTEXT - 3}" in \
        err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        stack.client.completions.create(model="gpt-4", prompt="the")
    assert err.value.body["param"] == "model" and MODEL in err.value.body["message"]


@pytest.mark.server
def test_api_key_is_checked_as_bearer(stack):
    wrong = openai.OpenAI(base_url=stack.locked.url, api_key="guess", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    right = openai.OpenAI(base_url=stack.locked.url, api_key="sesame", max_retries=0, timeout=120)
    assert [m.id for m in right.models.list().data] == [MODEL]
    assert right.completions.create(model=MODEL, prompt=[4], max_tokens=2).choices[0].text == "t the"


@pytest.mark.server
def test_triton_down_is_a_503(stack):
    from pipeline.serve.openai.app import EndpointConfig, EndpointServer, find_model_folder

    cfg = EndpointConfig(grpc_url=f"127.0.0.1:{_free_port()}", model=MODEL,
                         model_folder=find_model_folder(stack.served.repository, MODEL))
    with EndpointServer(cfg, port=0) as down:
        client = openai.OpenAI(base_url=down.url, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt="the", max_tokens=2)
    assert err.value.status_code == 503 and "not reachable" in err.value.body["message"]


def _open_stream(url: str, body: dict) -> socket.socket:
    """A raw HTTP/1.1 POST to ``url`` (``http://host:port/v1/...``), returned once the first
    server-sent event has arrived; the caller closes the socket (a real client disconnect,
    independent of any HTTP client library's pooling or draining)."""
    hostport, path = url.removeprefix("http://").split("/", 1)
    host, port = hostport.rsplit(":", 1)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST /{path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(65536)
        assert chunk, received.decode(errors="replace")
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received.decode(errors="replace")
    return sock


@pytest.mark.server
def test_client_disconnect_cancels_the_triton_request(stack):
    cancelled_before = stack.logs().count("cancelled")
    # the whole context (CONTEXT - 3 tokens) takes the tiny LM many seconds: the disconnect, not
    # the end of the generation, must end the request
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": CONTEXT - 3, "stream": True, "ignore_eos": True}
    sock = _open_stream(stack.open.url + "/completions", body)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    deadline = time.monotonic() + 120  # a wait for the server's log line, not a speed bound
    while stack.logs().count("cancelled") == cancelled_before and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = [x for x in stack.logs().splitlines() if "cancelled" in x]
    assert len(lines) > cancelled_before, stack.logs()[-2000:]
    assert MODEL in lines[-1]
    if "after " in lines[-1]:
        assert int(lines[-1].split("after ")[1].split()[0]) < CONTEXT - 3
    again = stack.client.completions.create(model=MODEL, prompt=[4], max_tokens=50)
    assert again.choices[0].finish_reason == "stop"


@pytest.mark.server
@pytest.mark.skipif(not HAS_MESSAGES, reason="the generation model has no 'messages' input yet (GENERATE_INPUTS)")
def test_chat_completions_use_the_chat_template(stack):
    prompt = "the cat sat"  # the template joins the contents: same prompt as a completion
    reference = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                                extra_body={"ignore_eos": True})
    messages = [{"role": "system", "content": "the "}, {"role": "user", "content": "cat sat"}]
    out = stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                               extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == reference.choices[0].text
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens == len(stack.tok.encode(prompt).ids)

    chunks = list(stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                                       extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    named = [{**m, "name": "text"} for m in messages]  # AIPerf's chat; this template does not read name
    out = stack.client.chat.completions.create(model=MODEL, messages=named, max_tokens=6, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == reference.choices[0].text

    with pytest.raises(openai.BadRequestError) as err:
        stack.client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    assert err.value.body["param"] == "messages.0.role"


@pytest.mark.server
@pytest.mark.skipif(not HAS_MESSAGES, reason="the generation model has no sampling inputs yet (GENERATE_INPUTS)")
def test_seeded_sampling_is_reproducible(stack):
    def sample(seed):
        return stack.client.completions.create(model=MODEL, prompt="the cat", max_tokens=8, temperature=1.0,
                                               seed=seed, extra_body={"ignore_eos": True, "return_token_ids": True})

    first, again = sample(11), sample(11)
    assert first.choices[0].token_ids == again.choices[0].token_ids and len(first.choices[0].token_ids) == 8


@pytest.mark.server
def test_bench_client_agreement_fails_naming_the_prompt_that_differs(stack):
    """The openai client through the endpoint against recorded validate tokens: prompt 0's record is
    the graph's greedy decode, prompt 1's is not. At concurrency 1 that fails, naming prompt 1; batched,
    a prompt equal to a fresh batch-1 decode passes (check_greedy's rule), so it counts only in agreement."""
    from dataclasses import replace

    from pipeline.recipe.schema import ServeConfig
    from pipeline.serve.bench import bench_client_agreement
    from pipeline.serve.run import failures
    from serve_tiny import with_validate_greedy

    served = replace(stack.served, recipe=stack.served.recipe.model_copy(
        update={"serve": ServeConfig.model_validate({"concurrency": [1, 2]})}))
    true = with_validate_greedy(served, 4).artifacts["validate"].greedy_tokens["fp8"][1]
    served = with_validate_greedy(served, 4, change={1: [3 if true[0] == 2 else 2, *true[1:]]})
    result = bench_client_agreement(served, stack.open.url, log=lambda line: None)
    [one, two] = result["levels"]
    assert one["equal"] == 1 and [m["prompt"] for m in one["mismatches"]] == [1] and one["agreement"] < 1
    assert two["agreement"] < 1 and two["mismatches"] == []  # batched: a batch-1 rerun decides
    lines = failures({"llm": {"client_agreement": result}})
    assert lines[0].startswith("concurrency 1: prompt 1: MISMATCH with the validate tokens from position 0")
    assert "skipped" in result["perplexity"]  # no prompt logprobs on this branch


#: ``python -m pipeline serve`` on the tiny LM: the CLI with its recipe run replaced by serve_tiny's artifacts.
_SERVE_TINY = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from pipeline.cli import app as cli
from pipeline.serve.prepare import prepare
from serve_tiny import context_build, llm_artifacts, llm_recipe
ws = Path(sys.argv[1])
served = prepare(llm_recipe(ws), llm_artifacts(ws, [[4]], build=context_build(4096)), backends=["python"])
cli.load_from_args, cli._served = lambda args: served.recipe, lambda args, recipe=None: served
sys.exit(cli.main(["serve", "tiny.yaml", "--openai-port", "0"]))
"""


@pytest.mark.server
def test_sigterm_ends_open_streams_with_an_error_event_and_exits_cleanly(tmp_path):
    pytest.importorskip("pytriton")
    import os
    import re
    import signal
    import subprocess
    import sys

    import httpx

    tests = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_TINY, str(tmp_path), str(tests)], cwd=tests.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tests.parent)})
    try:
        url, lines = None, []
        while not (lines and lines[-1].startswith("serving; Ctrl-C")):
            line = proc.stdout.readline()
            assert line, "serve exited early:\n" + "".join(lines) + proc.stderr.read()
            lines.append(line)
            url = url or (m.group(1) if (m := re.search(r"endpoint: (http://\S+/v1)", line)) else None)
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4000, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:  # streaming for sure: now stop the server
                        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutdown", events[-3:]
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])  # ended by the signal
    assert proc.returncode == 0 and "tritonserver stopped (exit status 0)" in out, out + err
    said = "".join(lines)
    assert re.search(r"^tokenizer folder: \S+/tiny_generate/1 ", said, re.M), said  # AIPerf's --tokenizer
    assert "Traceback" not in err, err


# --- the loglikelihood contract, refused parameters, invalid values -------------------------


@pytest.mark.parametrize("body,param", [
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1}, "frequency_penalty"), ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"made_up": 1}, "made_up"),
    ({"max_tokens": 4294967299}, "max_tokens"), ({"seed": 2**63}, "seed"), ({"seed": -1}, "seed"),
    ({"top_k": 2**31}, "top_k"), ({"logprobs": 6}, "logprobs"), ({"prompt": "a\ud800"}, "prompt"),
    ({"stop": ["ok", "\udfff"]}, "stop.1"), ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"prompt": ["a", "b"], "stream": True}, "prompt"), ({"max_tokens": 0}, "max_tokens")])
def test_unsupported_and_out_of_range_fields_are_400s_naming_them(body, param):
    with pytest.raises(ApiError) as err:
        parse_request(CompletionRequest, {"model": MODEL, "prompt": "a", **body})
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert err.value.message.startswith(f"{param}: ")
    assert err.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param,says", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop: at most 4 stop sequences (as OpenAI's API allows); got 5"),
    ({"stop": 5}, "stop", "stop: a string or a list of at most 4 strings; got 5"),
    ({"stop": ["a", 5]}, "stop.1", "stop.1: a string; got 5"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream_options: allowed only with stream true"),
    ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options", "stream_options: allowed only")])
def test_five_stops_and_stream_options_without_stream_are_400s_saying_why(body, param, says):
    """Five stops got "Input should be a valid string"; stream_options without stream was accepted."""
    from pipeline.serve.openai.requests import ChatRequest

    for cls, base in ((CompletionRequest, {"prompt": "a"}), (ChatRequest, {"messages": [{"role": "user", "content": "a"}]})):
        with pytest.raises(ApiError) as err:
            parse_request(cls, {"model": MODEL, **base, **body})
        assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(says), err.value.message
    assert parse_request(CompletionRequest, {"model": MODEL, "prompt": "a", "stop": ["a", "b", "c", "d"]}).stops() == [
        "a", "b", "c", "d"]
    assert parse_request(CompletionRequest, {"model": MODEL, "prompt": "a", "stream_options": None}).stream is False


def test_what_standard_clients_send_is_accepted():
    from pipeline.serve.openai.requests import ChatRequest

    lm_eval = {"model": MODEL, "prompt": [[1, 2, 3]], "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    req = parse_request(CompletionRequest, lm_eval)
    assert req.prompts() == [[1, 2, 3]] and req.echo and req.logprobs == 1
    sdk = {"model": MODEL, "prompt": "a", "n": 1, "user": "u1", "stream": True,
           "stream_options": {"include_usage": True}, "presence_penalty": 0, "frequency_penalty": 0.0,
           "logit_bias": {}, "best_of": 1}
    assert parse_request(CompletionRequest, sdk).include_usage()
    assert parse_request(CompletionRequest, {"model": MODEL, "prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert parse_request(CompletionRequest, {"model": MODEL, "prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert parse_request(CompletionRequest, {"model": MODEL, "prompt": [5, 6]}).prompts() == [[5, 6]]
    chat = parse_request(ChatRequest, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "logprobs": True, "top_logprobs": 2, "seed": 2**63 - 1})
    assert chat.messages[0].text() == "hi" and chat.top_logprobs == 2


@pytest.mark.parametrize("message,param", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages.0.content.0.type"),
    ({"role": "user", "content": "hi", "name": 5}, "messages.0.name"),
    ({"role": "assistant", "content": "", "tool_calls": []}, "messages.0.tool_calls")])
def test_chat_parts_and_fields_the_endpoint_lacks_are_refused(message, param):
    from pipeline.serve.openai.requests import ChatRequest

    with pytest.raises(ApiError) as err:
        parse_request(ChatRequest, {"model": MODEL, "messages": [message]})
    assert err.value.status == 400 and err.value.param == param, err.value.message


#: A chat template that reads ``name`` (as some do), and one that does not (it is dropped)
NAMED_TEMPLATE = "{% for m in messages %}{{ m['name'] ~ ': ' if m.name is defined else '' }}{{ m['content'] }}\n{% endfor %}"


def test_a_message_name_reaches_the_chat_template_as_transformers_passes_it(tmp_path, monkeypatch):
    """AIPerf 0.5's chat sends ``name: "text"`` in every message: accepted, and the message dict goes to
    the template as it is (a template that reads ``name`` shows it, one that does not drops it)."""
    from transformers import AutoTokenizer

    from pipeline.models.text_generation.served import chat
    from pipeline.serve.openai.requests import ChatRequest

    aiperf = {"model": MODEL, "messages": [{"role": "user", "name": "text", "content": "the cat"},
                                           {"role": "assistant", "content": "sat"}], "stream": True}
    req = parse_request(ChatRequest, aiperf)
    messages = [m.for_template() for m in req.messages]
    assert messages == [{"role": "user", "content": "the cat", "name": "text"}, {"role": "assistant", "content": "sat"}]
    sent = chat.parse_messages(json.dumps(messages))  # the generation model: parse_messages, then render_chat
    folder = tiny_metaspace(tmp_path / "tok", EOS_IDS)
    for template, expected in ((NAMED_TEMPLATE, "text: the cat\nsat\n"), (CHAT_TEMPLATE, "the catsat")):
        (folder / "chat_template.jinja").write_text(template)
        ours = chat.render_chat(chat.load_chat_template(str(folder)), sent, chat.special_tokens(str(folder)))
        theirs = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, tokenize=False,
                                                                                 add_generation_prompt=True)
        assert ours == theirs == expected


def _post(url: str, body, *, raw: bytes | None = None):
    import httpx

    data = raw if raw is not None else json.dumps(body, ensure_ascii=True).encode()
    return httpx.post(url, content=data, headers={"Content-Type": "application/json"}, timeout=120)


def _graph_logprobs(stack, ids: list[int]) -> np.ndarray:
    from test_serve_generation import reference_logprobs

    return reference_logprobs(stack.onnx_path, ids)


@pytest.mark.server
def test_echo_logprobs_score_the_prompt_then_one_generated_token(stack):
    prompts = [[4, 2, 3, 5, 7], [1, 2, 3]]
    out = stack.client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, echo=True, logprobs=1,
                                          temperature=0, seed=1234)
    assert [c.index for c in out.choices] == [0, 1]  # a batch: one choice per prompt
    for prompt, choice in zip(prompts, out.choices):
        ref = _graph_logprobs(stack, prompt)
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:len(prompt)], [ref[i, prompt[i + 1]] for i in
                                                                      range(len(prompt) - 1)], atol=1e-4)
        generated = int(np.argmax(ref[-1]))
        assert lp.token_logprobs[-1] == pytest.approx(ref[-1, generated], abs=1e-4)
        assert "".join(lp.tokens) == stack.tok.decode(prompt + [generated], skip_special_tokens=False)
        assert lp.text_offset == list(np.cumsum([0] + [len(s) for s in lp.tokens[:-1]]))
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
        assert choice.text.startswith(stack.tok.decode(prompt, skip_special_tokens=False))
    assert out.usage.prompt_tokens == 8 and out.usage.completion_tokens == 2


@pytest.mark.server
def test_echo_with_max_tokens_0_and_1_even_at_eos(stack):
    only = stack.client.completions.create(model=MODEL, prompt=[[4, 10, 2]], max_tokens=0, echo=True, logprobs=0)
    lp = only.choices[0].logprobs
    assert len(lp.tokens) == 3 and only.choices[0].finish_reason == "length" and only.usage.completion_tokens == 0
    eos = stack.client.completions.create(model=MODEL, prompt=[[4, 10, 2]], max_tokens=1, echo=True, logprobs=1)
    lp1 = eos.choices[0].logprobs  # [4, 10, 2] greedily continues with EOS 8: still appended
    assert len(lp1.tokens) == 4 and lp1.tokens[-1] == "." and eos.choices[0].finish_reason == "stop"
    assert lp1.token_logprobs[:3] == pytest.approx([None, *lp.token_logprobs[1:]], abs=1e-6)
    text = stack.client.completions.create(model=MODEL, prompt=["the cat sat", "on the mat"], max_tokens=0,
                                           echo=True, logprobs=2)
    for choice, prompt in zip(text.choices, ["the cat sat", "on the mat"]):
        ids = stack.tok.encode(prompt).ids
        assert choice.text == prompt and len(choice.logprobs.tokens) == len(ids)
        assert all(len(t) == 2 for t in choice.logprobs.top_logprobs[1:])


@pytest.mark.server
def test_generated_token_logprobs_on_completions_and_chat(stack):
    out = stack.client.completions.create(model=MODEL, prompt=[4], max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == "t the." and len(lp.token_logprobs) == 3 and lp.text_offset[0] == 0
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    ref = _graph_logprobs(stack, [4])
    assert lp.token_logprobs[0] == pytest.approx(ref[0].max(), abs=1e-4)
    if HAS_MESSAGES:
        chat = stack.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the cat"}],
                                                    max_tokens=3, logprobs=True, top_logprobs=3,
                                                    extra_body={"ignore_eos": True})
        content = chat.choices[0].logprobs.content
        assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
        assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy: the top one
        assert "".join(c.token for c in content) == chat.choices[0].message.content


@pytest.mark.server
def test_a_continuation_keeps_its_word_initial_space_in_text_and_logprob_tokens(stack):
    """Metaspace: the first generated token decoded after the prompt, not alone."""
    prompt = "the cat"
    out = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=1,
                                          extra_body={"ignore_eos": True})
    choice = out.choices[0]
    ids = stack.tok.encode(prompt).ids
    generated = stack.tok.encode(prompt + choice.text).ids[len(ids):]
    assert choice.text == stack.tok.decode(ids + generated)[len(stack.tok.decode(ids)):]
    assert "".join(choice.logprobs.tokens) == choice.text


@pytest.mark.server
def test_prompt_over_the_context_is_a_400_naming_the_limit(stack):
    with pytest.raises(openai.BadRequestError) as err:
        stack.client.completions.create(model=MODEL, prompt=[[4] * (CONTEXT + 1)], max_tokens=0, echo=True,
                                        logprobs=1)
    assert f"the context limit is {CONTEXT} tokens" in err.value.body["message"]
    assert err.value.body["param"] == "prompt"


@pytest.mark.server
def test_bad_values_are_openai_shaped_400s_over_http(stack):
    url = stack.open.url
    cases = [({"model": MODEL, "prompt": "a", "max_tokens": 4294967299}, "max_tokens"),
             ({"model": MODEL, "prompt": "a", "seed": 2**63}, "seed"),
             ({"model": MODEL, "prompt": "\ud800", "max_tokens": 2}, "prompt"),
             ({"model": MODEL, "prompt": "a", "stop": ["\ud800"]}, "stop.0"),
             ({"model": MODEL, "prompt": "a", "logit_bias": {"1": 5}}, "logit_bias"),
             ({"model": MODEL, "prompt": [10**6], "max_tokens": 1}, "prompt")]  # out of the vocabulary
    for body, param in cases:
        response = _post(url + "/completions", body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    oov = _post(url + "/completions", cases[-1][0]).json()["error"]["message"]
    assert "prompt: token ids must be" in oov and "input_ids" not in oov
    chat = _post(url + "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                             "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "tools"
    broken = _post(url + "/completions", None, raw=b'{"model": "tiny_generate", "prompt": "\xff\xfe"}')
    assert broken.status_code == 400 and "error" in broken.json()


@pytest.mark.server
def test_unknown_routes_and_methods_get_openai_shaped_errors(stack):
    import httpx

    base = stack.open.url.removesuffix("/v1")
    missing = httpx.post(base + "/v1/embeddings", json={"model": MODEL, "input": "a"})
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["type"] == "invalid_request_error" and "POST /v1/completions" in error["message"]
    wrong = httpx.get(base + "/v1/completions")
    assert wrong.status_code == 405 and "GET is not allowed on /v1/completions" in wrong.json()["error"]["message"]
    assert "POST" in wrong.headers.get("allow", "")


@pytest.mark.server
def test_tokenizer_routes_at_the_server_root(stack):
    """vLLM's tokenizer routes, at the root as lm-eval's remote tokenizer asks for them (the base_url
    without /v1/completions), on the served tokenizer.json; /v1/models gives the served context."""
    import httpx

    root = stack.open.url.removesuffix("/v1")
    info = httpx.get(root + "/tokenizer_info", timeout=60).json()
    assert info == {"eos_token": "<eos>", "bos_token": None, "pad_token": None, "unk_token": None,
                    "chat_template": CHAT_TEMPLATE, "max_model_len": CONTEXT}
    text = "the cat<eos>"
    got = httpx.post(root + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60).json()
    assert got["tokens"] == stack.tok.encode(text, add_special_tokens=False).ids and got["count"] == len(got["tokens"])
    eos = httpx.post(root + "/tokenize", json={"prompt": "<eos>", "add_special_tokens": False}, timeout=60).json()
    assert eos["tokens"] == [0] and got["tokens"][-1] == 0  # the EOS text is its one id
    back = httpx.post(root + "/detokenize", json={"tokens": got["tokens"]}, timeout=60).json()
    assert back == {"prompt": stack.tok.decode(got["tokens"], skip_special_tokens=False)} and back["prompt"] == text
    for route, body, status, param in (("/tokenize", {"prompt": 5}, 400, "prompt"),
                                       ("/tokenize", {"prompt": "a", "made_up": 1}, 400, "made_up"),
                                       ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
                                       ("/detokenize", {"tokens": [10**6]}, 400, "tokens")):
        answer = httpx.post(root + route, json=body, timeout=60)
        assert answer.status_code == status and answer.json()["error"]["param"] == param, answer.text
    assert httpx.post(stack.open.url + "/tokenize", json={"prompt": "a"}, timeout=60).status_code == 404  # not /v1
    assert stack.client.models.list().data[0].model_extra["max_model_len"] == CONTEXT  # as vLLM reports it
    assert stack.client.models.retrieve(MODEL).model_extra["max_model_len"] == CONTEXT


@pytest.mark.server
def test_model_and_health_routes(stack):
    import httpx

    assert stack.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        stack.client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found"
    health = httpx.get(stack.open.url.removesuffix("/v1") + "/health", timeout=60)
    assert health.status_code == 200 and health.json() == {"status": "ok", "model": MODEL}


def test_a_client_gone_from_a_fast_non_streamed_generation_is_noticed():
    """Pieces that come faster than the poll interval still let the endpoint ask whether the
    client is there (a non-streamed request has no failed write to tell it): the generation
    stops and its Triton request is closed, long before the last piece."""
    import asyncio

    from pipeline.serve.openai.bridge import until_disconnect

    state = {"sent": 0, "closed": False}

    async def pieces():
        try:
            for _ in range(1000):
                await asyncio.sleep(0.001)
                state["sent"] += 1
                yield "x"
        finally:
            state["closed"] = True

    class Gone:
        async def is_disconnected(self):
            return True

    async def consume():
        return [p async for p in until_disconnect(Gone(), pieces(), poll_s=0.02)]

    with pytest.raises(ApiError) as e:
        asyncio.run(consume())
    assert e.value.status == 499 and state["closed"] and state["sent"] < 1000


@pytest.mark.parametrize("stats, finalize_logged, passes", [
    ({"inflight": 0}, False, True),    # idle, never finalized, exit timeout: the upstream hang, a warning
    (None, False, False),              # the model did not answer: not told apart from a hang of ours
    ({"inflight": 0}, True, False),    # finalize started and hung: ours
])
def test_stop_cleanly_excuses_only_the_upstream_unload_hang(monkeypatch, stats, finalize_logged, passes):
    import serve_tiny
    from pipeline.serve import client

    monkeypatch.setattr(client, "scheduler_statistics", lambda url, model: stats)
    log = "I server.cc] Timeout 0\nE main.cc] failed to stop server: Internal - Exit timeout expired."
    server = types.SimpleNamespace(grpc_url="127.0.0.1:1", stop=lambda: 1,
                                   logs=lambda: ("m: finalize: 0 requests in flight\n" if finalize_logged else "") + log)
    if passes:
        with pytest.warns(UserWarning, match="never called m's finalize"):
            serve_tiny.stop_cleanly(server, "m")
    else:
        with pytest.raises(AssertionError, match="Exit timeout expired"):
            serve_tiny.stop_cleanly(server, "m")
