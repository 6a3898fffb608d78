"""tritonclient calls: streamed generation (gRPC, decoupled), inference, statistics.

Times are ``time.perf_counter()`` seconds taken in this process: a token's
time is when its response reached the client callback.
"""
from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from pipeline.errors import PipelineError

#: numpy dtype -> Triton wire type name.
WIRE_TYPES = {np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32",
              np.dtype(np.float16): "FP16", np.dtype(np.bool_): "BOOL", np.dtype(np.object_): "BYTES"}


class ServeClientError(PipelineError):
    """The server answered a request with an error, or did not answer in time."""


@dataclass
class Generation:
    """One streamed generation: its tokens and when each arrived (s, perf_counter)."""

    sent: float
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    text: str = ""
    #: "stop" (EOS), "length" (max_tokens or the context limit; ``detail`` says which),
    #: "cancelled" (:meth:`StreamClient.close` before the end); "" while it streams or
    #: when the server's model sends no ``finish_reason``.
    finish_reason: str = ""
    detail: str = ""
    model: str = ""

    @property
    def ttft_ms(self) -> float:
        """Time to first token, ms: first token's arrival minus the send time."""
        return (self.times[0] - self.sent) * 1e3

    @property
    def gaps_ms(self) -> list[float]:
        """Inter-token latencies, ms: ``gaps_ms[k - 1]`` = arrival of token k minus token k - 1."""
        return list(np.diff(self.times) * 1e3)

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first, ms: (last - first arrival) / (tokens - 1);
        NaN for a single token. (The TPOT of vLLM's benchmark_serving and genai-perf.)"""
        n = len(self.times)
        return (self.times[-1] - self.times[0]) * 1e3 / (n - 1) if n > 1 else float("nan")

    @property
    def latency_ms(self) -> float:
        return (self.times[-1] - self.sent) * 1e3


def tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    """A gRPC InferInput holding ``array`` (shape and type from the array)."""
    array = np.ascontiguousarray(array)
    value = grpcclient.InferInput(name, list(array.shape), WIRE_TYPES[array.dtype])
    value.set_data_from_numpy(array)
    return value


def generation_inputs(*, input_ids=None, text: str | None = None, max_tokens: int | None = None,
                      ignore_eos: bool = False, **optional: Any) -> list[grpcclient.InferInput]:
    """Inputs of the generation model: ``input_ids`` int64 [n] or ``text``, plus options
    (``max_tokens`` INT32 [1]: any integer; the server refuses one below 1). ``optional``:
    inputs sent only when given and not None (notes/genapi.md): ``messages`` (a list of
    {"role", "content"} dicts, sent as JSON), ``temperature`` / ``top_p`` (FP32 [1]),
    ``top_k`` (INT32 [1]), ``seed`` (INT64 [1]), ``stop`` (list of strings, BYTES [k]),
    ``scheduler_stats`` (BOOL [1]), ``prompt_logprobs`` / ``logprobs`` (INT32 [1], top counts).

    Raises:
        PipelineError: ``max_tokens`` is not an integer (it would be truncated to one).
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer))):
        raise PipelineError(f"max_tokens must be an integer >= 1; got {max_tokens!r}")
    inputs = []
    if input_ids is not None:
        inputs.append(tensor("input_ids", np.asarray(input_ids, np.int64).reshape(-1)))
    if text is not None:
        inputs.append(tensor("text_input", np.array([text.encode()], dtype=np.object_)))
    if max_tokens is not None:
        inputs.append(tensor("max_tokens", np.array([max_tokens], np.int32)))
    if ignore_eos:
        inputs.append(tensor("ignore_eos", np.array([True])))
    for name, value in optional.items():
        if value is None:
            continue
        if name not in OPTIONAL_INPUTS:
            raise PipelineError(f"{name}: not an input of the generation model; known: {', '.join(OPTIONAL_INPUTS)}")
        inputs.append(tensor(name, OPTIONAL_INPUTS[name](value)))
    return inputs


#: Optional generation inputs -> their array (see :func:`generation_inputs`).
OPTIONAL_INPUTS = {
    "messages": lambda v: np.array([json.dumps(v).encode()], dtype=np.object_),
    "temperature": lambda v: np.array([v], np.float32),
    "top_p": lambda v: np.array([v], np.float32),
    "top_k": lambda v: np.array([v], np.int32),
    "seed": lambda v: np.array([v], np.int64),
    "stop": lambda v: np.array([x.encode() for x in ([v] if isinstance(v, str) else v)], dtype=np.object_),
    "scheduler_stats": lambda v: np.array([bool(v)]),
    "prompt_logprobs": lambda v: np.array([v], np.int32),
    "logprobs": lambda v: np.array([v], np.int32),
}


def scheduler_statistics(url: str, model: str, timeout_s: float = 60.0) -> dict | None:
    """The generation model's own scheduler statistics (``scheduler_stats`` request: JSON with
    ``executions_by_batch_size`` {size (str): compute calls}, ``steps``, ``mean_batch``, ...);
    None when the model has no such input or answers with an error."""
    try:
        with StreamClient(url, timeout_s=timeout_s) as client:
            gen = client.generate(model, scheduler_stats=True)
        return json.loads(gen.text)
    except (ServeClientError, ValueError):
        return None


class StreamClient:
    """One gRPC stream to a decoupled model; one request in flight at a time.

        with StreamClient(server.grpc_url) as c:
            g = c.generate("smollm2_generate", input_ids=[...], max_tokens=32)

    Or response by response: ``g = c.start(model, ...)``, then ``c.receive(g)`` until it
    returns True; :meth:`close` in between cancels the request on the server.
    """

    def __init__(self, url: str, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self._responses: queue.Queue = queue.Queue()
        self._active: Generation | None = None
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(
            callback=lambda result, error: self._responses.put((time.perf_counter(), result, error)))

    def generate(self, model: str, **inputs: Any) -> Generation:
        """Send one request (see :func:`generation_inputs`) and collect its whole stream.

        Raises:
            PipelineError: a ``max_tokens`` that is not an integer.
            ServeClientError: an error response, or no response for ``timeout_s``.
        """
        gen = self.start(model, **inputs)
        while not self.receive(gen):
            pass
        return gen

    def start(self, model: str, **inputs: Any) -> Generation:
        """Send one request (see :func:`generation_inputs`); read its responses with :meth:`receive`.

        Raises:
            PipelineError: a request is still in flight on this stream, or a bad ``max_tokens``.
        """
        if self._active is not None:
            raise PipelineError(f"{model}: a request to {self._active.model} is still streaming on this client; "
                                "receive it to the end or close() the client first")
        request = generation_inputs(**inputs)
        gen = Generation(sent=time.perf_counter(), model=model)
        self.client.async_stream_infer(model, request, enable_empty_final_response=True)
        self._active = gen
        return gen

    def receive(self, gen: Generation) -> bool:
        """Wait for ``gen``'s next response and add its token, text and (final) finish reason.

        Returns True once that was the final response. A response without ``token_ids``
        adds no token.

        Raises:
            ServeClientError: an error response (the request is then over), or no
                response for ``timeout_s``.
        """
        try:
            at, result, error = self._responses.get(timeout=self.timeout_s)
        except queue.Empty:
            raise ServeClientError(f"{gen.model}: no response for {self.timeout_s:.0f}s") from None
        if error is not None:
            self._active = None
            raise ServeClientError(f"{gen.model}: {error}")
        response = result.get_response()
        names = {o.name for o in response.outputs}
        if "token_ids" in names:
            gen.tokens.append(int(result.as_numpy("token_ids")[0]))
            gen.times.append(at)
        if "text_output" in names:
            gen.text += result.as_numpy("text_output")[0].decode("utf-8", "replace")
        if "finish_reason" in names:
            gen.finish_reason = result.as_numpy("finish_reason")[0].decode()
            gen.detail = result.as_numpy("detail")[0].decode() if "detail" in names else ""
        if not response.parameters["triton_final_response"].bool_param:
            return False
        self._active = None
        return True

    def close(self) -> None:
        """Cancel the request in flight, if any (its :class:`Generation` gets finish_reason
        "cancelled"; the server ends it with the CANCELLED error at its next step), and
        close the stream, without waiting for the generation to end.

        With nothing in flight the stream is closed without a cancel: tritonserver 2.51 then
        cannot unload a model whose request it had rejected on that stream (e.g. a wrong
        input type), and its shutdown runs into the exit timeout.
        """
        active, self._active = self._active, None
        if active is not None:
            active.finish_reason = "cancelled"
        self.client.stop_stream(cancel_requests=active is not None)
        self.client.close()

    def __enter__(self) -> "StreamClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def infer_ms(client: grpcclient.InferenceServerClient, model: str, inputs: dict[str, np.ndarray]) -> float:
    """One synchronous inference; its latency in ms as seen by the client.

    Raises:
        ServeClientError: the server answered with an error.
    """
    start = time.perf_counter()
    try:
        client.infer(model, [tensor(n, a) for n, a in inputs.items()])
    except Exception as e:  # InferenceServerException and transport errors
        raise ServeClientError(f"{model}: {e}") from e
    return (time.perf_counter() - start) * 1e3


def model_statistics(client: grpcclient.InferenceServerClient, model: str) -> dict:
    """Triton's statistics extension for ``model`` (all versions summed), as plain ints.

    Returns ``{"inference_count", "execution_count", "compute_infer_ns",
    "queue_ns", "batches": {batch size: executions}}``. ``compute_infer_ns``
    sums ``batch_stats`` (one entry per execution; ``inference_stats`` would
    count a batch's time once per request in it); ``queue_ns`` is per request.
    """
    return parse_statistics(client.get_inference_statistics(model, as_json=True))


def settled_statistics(client: grpcclient.InferenceServerClient, model: str, at_least: int,
                       timeout_s: float = 10.0) -> dict:
    """:func:`model_statistics` once they count ``at_least`` inferences: Triton may update them
    just after the answer reaches the client, so a reading taken at once can miss the last ones.

    Raises:
        ServeClientError: still fewer after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        stats = model_statistics(client, model)
        batched = sum(int(k) * n for k, n in stats["batches"].items())
        # Triton updates the count and the per-batch-size executions separately: wait for both (an
        # empty batch table after an inference is one not yet recorded, not one that never will be).
        settled = batched >= stats["inference_count"]
        if stats["inference_count"] >= at_least and (settled or time.monotonic() > deadline):
            return stats
        if time.monotonic() > deadline:
            raise ServeClientError(f"{model}: statistics count {stats['inference_count']} inferences, "
                                   f"expected at least {at_least} after {timeout_s:.0f}s")
        time.sleep(0.05)


def parse_statistics(stats: dict) -> dict:
    """The statistics extension's JSON (int64 fields may be strings) -> see :func:`model_statistics`."""
    out: dict = {"inference_count": 0, "execution_count": 0, "compute_infer_ns": 0, "queue_ns": 0, "batches": {}}
    for s in stats.get("model_stats", []):
        out["inference_count"] += int(s.get("inference_count", 0))
        out["execution_count"] += int(s.get("execution_count", 0))
        out["queue_ns"] += int(s.get("inference_stats", {}).get("queue", {}).get("ns", 0))
        for b in s.get("batch_stats", []):
            size, compute = int(b["batch_size"]), b.get("compute_infer", {})
            out["batches"][size] = out["batches"].get(size, 0) + int(compute.get("count", 0))
            out["compute_infer_ns"] += int(compute.get("ns", 0))
    return out


# ---------------------------------------------------------------- HTTP routes (AIPerf's, for the cross-check)

def kserve_json_body(inputs: dict[str, np.ndarray]) -> dict:
    """The KServe v2 JSON inference request for ``inputs`` (name -> array, batch axis included):
    ``{"inputs": [{"name", "shape", "datatype", "data"}]}`` with ``data`` the row-major values (BYTES
    as UTF-8 strings), no ``outputs`` (Triton then returns every output as JSON numbers)
    (https://kserve.github.io/website/docs/concepts/architecture/data-plane/v2-protocol). For one
    BYTES ``[1, 1]`` text input it is the body AIPerf's template endpoint sends
    (:func:`pipeline.serve.crosscheck.kserve_template`)."""
    body = []
    for name, array in inputs.items():
        a = np.asarray(array)
        data = [v.decode() if isinstance(v, bytes) else str(v) for v in a.reshape(-1)] if a.dtype == np.object_ \
            else a.reshape(-1).tolist()
        body.append({"name": name, "shape": list(a.shape), "datatype": WIRE_TYPES[a.dtype], "data": data})
    return {"inputs": body}


def completions_body(model: str, prompt: str, max_tokens: int, *, ignore_eos: bool) -> dict:
    """The streamed ``/v1/completions`` request AIPerf 0.5's ``completions`` endpoint sends with
    ``--streaming``, ``--osl`` and ``--extra-inputs ignore_eos:true``: ``{"prompt": [text], "model",
    "stream": true, "max_tokens"[, "ignore_eos": true]}`` (no ``stream_options``: AIPerf counts output
    tokens itself)."""
    return {"prompt": [prompt], "model": model, "stream": True, "max_tokens": int(max_tokens),
            **({"ignore_eos": True} if ignore_eos else {})}


class _KeepAlive:
    """One HTTP/1.1 keep-alive connection (httpx) to ``base_url``, closed by :meth:`close` or the
    ``with`` block: the base of the AIPerf-route clients below."""

    def __init__(self, base_url: str, timeout_s: float):
        import httpx

        # one keep-alive connection; no proxy from the environment (the server is local, as AIPerf's aiohttp)
        self.client = httpx.Client(base_url=base_url, timeout=httpx.Timeout(timeout_s), trust_env=False,
                                   limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))

    def close(self) -> None:
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KServeHTTP(_KeepAlive):
    """One HTTP/1.1 keep-alive connection (httpx) to Triton's KServe v2 JSON route
    ``POST /v2/models/<model>/infer``: the encoder route AIPerf's template endpoint drives.

        with KServeHTTP(server.http_url) as c:      # "127.0.0.1:8000"
            ms = c.infer_ms("enc_ensemble", {"text": np.array([[b"a sentence"]], dtype=np.object_)})
    """

    def __init__(self, http_url: str, timeout_s: float = 300.0):
        super().__init__(f"http://{http_url}", timeout_s)

    def infer_ms(self, model: str, inputs: dict[str, np.ndarray]) -> float:
        """One inference (:func:`kserve_json_body`); its latency in ms from the send to the whole
        response read. The JSON answer is parsed after (as AIPerf reads ``outputs[0].data``).

        Raises:
            ServeClientError: a transport error, a status other than 200, or an answer without outputs.
        """
        import httpx

        content = json.dumps(kserve_json_body(inputs)).encode()
        start = time.perf_counter()
        try:
            r = self.client.post(f"/v2/models/{model}/infer", content=content,
                                 headers={"Content-Type": "application/json"})
        except httpx.HTTPError as e:
            raise ServeClientError(f"{model}: {type(e).__name__}: {e}") from e
        ms = (time.perf_counter() - start) * 1e3
        if r.status_code != 200:
            raise ServeClientError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
        try:
            outputs = r.json()["outputs"]
            outputs[0]["data"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ServeClientError(f"{model}: the answer has no outputs[0].data: {r.text[:300]}") from None
        return ms


class CompletionsHTTP(_KeepAlive):
    """One HTTP/1.1 keep-alive connection (httpx) to an OpenAI-compatible endpoint's streamed
    ``POST /v1/completions`` (server-sent events): the generation route AIPerf drives.

        with CompletionsHTTP(endpoint.url, count=tokenizer.encode) as c:   # url ends in /v1
            g = c.generate("smollm2_generate", "Once upon a time", max_tokens=32, ignore_eos=True)

    ``count``: text -> its token ids, for :attr:`Generation.tokens` (the output counted by the served
    tokenizer, as AIPerf counts it client-side); None leaves ``tokens`` empty.
    """

    def __init__(self, base_url: str, count=None, timeout_s: float = 300.0):
        super().__init__(base_url.rstrip("/"), timeout_s)
        self.count = count

    def generate(self, model: str, prompt: str, *, max_tokens: int, ignore_eos: bool = False) -> Generation:
        """Send :func:`completions_body` and read its stream to ``data: [DONE]``.

        Returns a :class:`Generation`: ``sent`` before the send; ``times``: the arrival of each event
        with non-empty text (so TTFT is the first content chunk's); ``text``; ``finish_reason``;
        ``tokens``: ``count(text)`` (ids of the whole text re-tokenized; their number, not a per-chunk
        record).

        Raises:
            ServeClientError: a transport error, a status other than 200, an error event, or a stream
                with no text.
        """
        import httpx

        gen = Generation(sent=time.perf_counter(), model=model)
        try:
            with self.client.stream("POST", "/completions",
                                    json=completions_body(model, prompt, max_tokens, ignore_eos=ignore_eos)) as r:
                if r.status_code != 200:
                    r.read()
                    raise ServeClientError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise ServeClientError(f"{model}: error event: {json.dumps(event['error'])[:300]}")
                    for choice in event.get("choices") or []:  # one prompt: one choice (none in a usage chunk)
                        if choice.get("text"):
                            gen.times.append(time.perf_counter())
                            gen.text += choice["text"]
                        if choice.get("finish_reason"):
                            gen.finish_reason = choice["finish_reason"]
        except httpx.HTTPError as e:
            raise ServeClientError(f"{model}: {type(e).__name__}: {e}") from e
        except ValueError as e:  # an event that is not JSON
            raise ServeClientError(f"{model}: a server-sent event is not JSON: {e}") from e
        if not gen.times:
            raise ServeClientError(f"{model}: the stream ended without text (finish_reason {gen.finish_reason!r})")
        if self.count is not None:
            gen.tokens = list(self.count(gen.text))
        return gen
