"""The OpenAI endpoint's Triton side: one OpenAI request as a generation-model request.

:class:`TritonGenerator` streams one request over gRPC (``tritonclient.grpc.aio``);
:func:`triton_inputs` / :func:`score_inputs` map request fields to the model's inputs;
:class:`Run` turns the model's responses into OpenAI's bodies (whole JSON or server-sent
events), cutting the text at stop strings (:class:`StopText`) and cancelling the Triton request
when the client goes (:func:`until_disconnect`). The HTTP routes live in
:mod:`pipeline.serve.openai.app`; the request schema in :mod:`pipeline.serve.openai.requests`.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.serve.openai.requests import ApiError, CompletionRequest, _Request

#: Inputs whose values are sent only when the request uses them, with the value that
#: equals "not sent" (the model's default) for a model that lacks the input.
SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": None}


# --- errors -------------------------------------------------------------------------------------------------


def unavailable(url: str, error: BaseException) -> ApiError:
    return ApiError(503, f"the Triton server at {url} is not reachable ({error}); is it running?",
                    type_="service_unavailable", code="triton_unavailable")


# --- the Triton side -------------------------------------------------------------------------------------


@dataclass
class Piece:
    """One response of the generation model: new text, its token (None in a response
    without ``token_ids``), on the final response ``finish_reason`` and ``detail``, and the
    ``scores`` output's JSON (prompt / token logprobs) when the request asked for them."""

    text: str = ""
    token: int | None = None
    finish_reason: str = ""
    detail: str = ""
    scores: dict | None = None


def _tensor(grpc, name: str, array: np.ndarray):
    from pipeline.serve.client import WIRE_TYPES

    value = grpc.InferInput(name, list(array.shape), WIRE_TYPES[array.dtype])
    value.set_data_from_numpy(array)
    return value


def _strings(values: list[str]) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


class TritonGenerator:
    """The generation model over gRPC streaming (one stream per request).

    Make it inside the event loop that uses it (the aio channel belongs to that loop).
    """

    def __init__(self, url: str, model: str):
        import tritonclient.grpc.aio as aio

        self.url, self.model = url, model
        self.client = aio.InferenceServerClient(url)
        self._inputs: set[str] | None = None

    async def inputs(self) -> set[str]:
        """Input names of the served generation model (read once from its metadata).

        Raises:
            ApiError: 503 when Triton is not reachable or the model is not loaded.
        """
        if self._inputs is None:
            try:
                meta = await self.client.get_model_metadata(self.model, as_json=True)
            except Exception as e:  # InferenceServerException wraps every gRPC failure
                raise unavailable(self.url, e) from e
            self._inputs = {i["name"] for i in meta.get("inputs", [])}
        return self._inputs

    async def stream(self, request: dict[str, Any]) -> AsyncIterator[Piece]:
        """Send one request (input name -> value; see :func:`triton_inputs`) and yield its
        responses until the one with ``finish_reason``. Closing the iterator early (or
        cancelling the task awaiting it) cancels the request on the server.

        Raises:
            ApiError: 400 the model answered with an error (a bad value names its input);
                503 Triton unreachable.
        """
        import tritonclient.grpc.aio as aio

        inputs = [_tensor(aio, name, value) for name, value in request.items()]
        finished = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": inputs}
            await finished.wait()  # keep the stream open until the last response

        responses = self.client.stream_infer(requests())
        try:
            async for result, error in _guard(self.url, responses):
                if error is not None:
                    raise ApiError(400, f"{self.model}: {_openai_names(error.message())}",
                                   param=_param_of(error.message()), code="generation_error")
                piece = _piece(result)
                if piece.finish_reason:
                    finished.set()
                yield piece
                if piece.finish_reason:
                    return
            raise ApiError(503, f"{self.model}: the stream ended without a final response",
                           type_="service_unavailable")
        finally:
            if not finished.is_set():
                responses.cancel()  # the server cancels the request (CANCELLED at its next step)
                finished.set()

    async def close(self) -> None:
        await self.client.close()


#: the generation model's prompt inputs -> the OpenAI field they come from
_PROMPT_INPUTS = re.compile(r"\b(input_ids|text_input)\b")


def _param_of(message: str) -> str | None:
    """The request field a generation model's error names (its inputs keep the OpenAI names, but
    for the prompt's ``input_ids`` / ``text_input``), or None: ``prompt`` for a prompt that alone
    fills the context or holds a token id outside the vocabulary."""
    if message.startswith("prompt has") or _PROMPT_INPUTS.match(message):
        return "prompt"
    found = re.search(r"\b(max_tokens|temperature|top_p|top_k|seed|stop|messages)\b", message)
    return found.group(1) if found else None


def _openai_names(message: str) -> str:
    """``message`` with a leading Triton prompt input named as the OpenAI field
    (``input_ids must be ...`` -> ``prompt: token ids must be ...``)."""
    found = _PROMPT_INPUTS.match(message)
    if not found:
        return message
    what = "token ids" if found.group(1) == "input_ids" else "the text"
    return f"prompt: {what}{message[found.end():]}"


async def _guard(url: str, responses) -> AsyncIterator:
    """``responses`` with transport failures turned into 503."""
    while True:
        try:
            item = await responses.__anext__()
        except StopAsyncIteration:
            return
        except Exception as e:  # grpc.aio.AioRpcError: UNAVAILABLE and similar
            if type(e).__name__ == "CancelledError":
                raise
            raise unavailable(url, e) from e
        yield item


def _piece(result) -> Piece:
    names = {o.name for o in result.get_response().outputs}

    def text(name: str) -> str:
        return result.as_numpy(name)[0].decode("utf-8", "replace") if name in names else ""

    token = int(result.as_numpy("token_ids")[0]) if "token_ids" in names else None
    scores = json.loads(text("scores")) if "scores" in names else None
    return Piece(text("text_output"), token, text("finish_reason"), text("detail"), scores)


def triton_inputs(req: _Request, supported: set[str], *, default_max_tokens: int | None) -> dict[str, np.ndarray]:
    """The generation model's inputs for an OpenAI request (prompt / messages excluded).

    Raises:
        ApiError: 400 a sampling field with a non-default value that the served model lacks.
    """
    out: dict[str, np.ndarray] = {}
    max_tokens = next((v for v in (req.max_completion_tokens, req.max_tokens, default_max_tokens) if v is not None),
                      None)
    if max_tokens is not None:
        out["max_tokens"] = np.array([max_tokens], np.int32)
    if req.ignore_eos:
        out["ignore_eos"] = np.array([True])
    values = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
              "stop": req.stops() or None}
    arrays = {"temperature": lambda v: np.array([v], np.float32), "top_p": lambda v: np.array([v], np.float32),
              "top_k": lambda v: np.array([v], np.int32), "seed": lambda v: np.array([v], np.int64),
              "stop": _strings}
    for name, value in values.items():
        if value is None:
            continue
        if name in supported:
            out[name] = arrays[name](value)
        elif name != "stop" and value != SAMPLING_DEFAULTS[name]:  # stop strings are applied here too
            raise ApiError(400, f"{name}: the served generation model has no '{name}' input (inputs: "
                                f"{', '.join(sorted(supported))}); leave it out or use the default "
                                f"{SAMPLING_DEFAULTS[name]!r}", param=name)
    return out


def _need(supported: set[str], name: str, param: str) -> None:
    if name not in supported:
        raise ApiError(400, f"{param}: the served generation model has no '{name}' input (inputs: "
                            f"{', '.join(sorted(supported))}); rebuild its repository with this version", param=param)


def score_inputs(req: CompletionRequest, supported: set[str]) -> dict[str, np.ndarray]:
    """``prompt_logprobs`` (echo with logprobs, or echo with max_tokens 0: the prompt is scored) and
    ``logprobs`` (generated tokens) inputs of a completion request.

    Raises:
        ApiError: 400 the served model lacks the input.
    """
    out = {}
    if req.echo and (req.logprobs is not None or req.max_tokens == 0):
        _need(supported, "prompt_logprobs", "echo")
        out["prompt_logprobs"] = np.array([req.logprobs or 0], np.int32)
    if req.logprobs is not None and req.max_tokens != 0:
        _need(supported, "logprobs", "logprobs")
        out["logprobs"] = np.array([req.logprobs], np.int32)
    return out


# --- one request's run ---------------------------------------------------------------------------------


class StopText:
    """Streamed text cut at the first stop string; holds back a tail that may start one."""

    def __init__(self, stops: list[str]):
        self.stops, self.shown, self.pending, self.stopped = stops, "", "", False

    def add(self, text: str) -> str:
        """The part of ``text`` that can be shown now ("" once stopped)."""
        if self.stopped:
            return ""
        buffer = self.pending + text
        hits = [(buffer.find(s), s) for s in self.stops if s in buffer]
        if hits:
            self.stopped, self.pending = True, ""
            return self._show(buffer[:min(hits)[0]])
        keep = max((k for s in self.stops for k in range(1, len(s)) if buffer.endswith(s[:k])), default=0)
        self.pending = buffer[len(buffer) - keep:] if keep else ""
        return self._show(buffer[:len(buffer) - keep])

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return self._show(out)

    def _show(self, text: str) -> str:
        self.shown += text
        return text


class Run:
    """One request's generation, answered whole (JSON) or streamed (server-sent events)."""

    def __init__(self, gen: TritonGenerator, inputs: dict, req: _Request, prompt_ids: list[int] | None, *,
                 kind: str, model: str):
        self.gen, self.inputs, self.req, self.prompt_ids = gen, inputs, req, prompt_ids
        self.prompt_tokens = None if prompt_ids is None else len(prompt_ids)
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.stop = StopText(req.stops())
        self.tokens: list[int] = []
        self.finish_reason = ""
        self.prompt_scores: dict | None = None  # {"ids", "logprobs", "top"} (prompt_logprobs asked)
        self.token_scores: list[dict] = []  # per generated token {"logprob", "top"} (logprobs asked)

    async def pieces(self) -> AsyncIterator[str]:
        """Visible text pieces; sets ``tokens`` and ``finish_reason``. Stops (and cancels the
        Triton request) at a stop string."""
        stream = self.gen.stream(self.inputs)
        try:
            async for piece in stream:
                if piece.token is not None:
                    self.tokens.append(piece.token)
                if piece.scores:
                    self.prompt_scores = piece.scores.get("prompt", self.prompt_scores)
                    if "token" in piece.scores:
                        self.token_scores.append(piece.scores["token"])
                text = self.stop.add(piece.text)
                if self.stop.stopped:
                    self.finish_reason = "stop"
                    yield text
                    return
                if piece.finish_reason:
                    self.finish_reason = "stop" if piece.finish_reason == "stop" else "length"
                    yield text + self.stop.flush()
                    return
                if text:
                    yield text
        finally:
            await stream.aclose()

    def usage(self) -> dict:
        prompt = self.prompt_tokens if self.prompt_tokens is not None else 0
        return {"prompt_tokens": prompt, "completion_tokens": len(self.tokens),
                "total_tokens": prompt + len(self.tokens)}

    async def respond(self, request, json_response, streaming_response):
        pieces = self.pieces()
        try:  # the first piece before any header: an error then still gets its status code
            first = await pieces.__anext__()
        except StopAsyncIteration:
            first = ""
        except BaseException:
            await pieces.aclose()
            raise
        if self.req.stream:
            return streaming_response(self._events(first, pieces), media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache"})
        text = first + "".join([p async for p in until_disconnect(request, pieces)])
        return json_response(self._whole(text))

    async def text(self, request) -> str:
        """The whole generated text (sets ``tokens``, ``finish_reason`` and the scores)."""
        return "".join([p async for p in until_disconnect(request, self.pieces())])

    def _choice(self, text: str, finish: str | None, *, delta: bool, index: int = 0,
                logprobs: dict | None = None) -> dict:
        if self.kind == "chat.completion":
            body = {"delta": {"content": text} if text else {}} if delta else {
                "message": {"role": "assistant", "content": text}, "logprobs": logprobs}
        else:
            body = {"text": text, "logprobs": logprobs}
        choice = {"index": index, **body, "finish_reason": finish}
        if self.req.return_token_ids and finish is not None:
            choice["token_ids"] = list(self.tokens)
        return choice

    def _whole(self, text: str, logprobs: dict | None = None) -> dict:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [self._choice(text, self.finish_reason, delta=False, logprobs=logprobs)],
                "usage": self.usage()}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        kind = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        body: dict = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                      "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def _events(self, first: str, pieces: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            if self.kind == "chat.completion":
                yield self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            if first:
                yield self._chunk([self._choice(first, None, delta=True)])
            try:
                async for text in pieces:
                    if text:
                        yield self._chunk([self._choice(text, None, delta=True)])
            except ApiError as e:  # after the headers: an error event, then the end
                yield f"data: {json.dumps(e.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            yield self._chunk([self._choice("", self.finish_reason, delta=True)])
            if self.req.include_usage():
                yield self._chunk([], self.usage())
            yield "data: [DONE]\n\n"
        finally:  # a client disconnect cancels this generator: cancel the Triton request
            await pieces.aclose()


async def until_disconnect(request, pieces: AsyncIterator[str], poll_s: float = 0.5) -> AsyncIterator[str]:
    """``pieces``, stopped (and the Triton request cancelled) once the HTTP client has gone. The
    client is asked at least every ``poll_s`` seconds, whether pieces come faster or slower than that."""
    checked = time.monotonic()
    while True:
        task = asyncio.ensure_future(pieces.__anext__())
        while True:
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() or time.monotonic() - checked >= poll_s:
                checked = time.monotonic()
                if await request.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await pieces.aclose()
                    raise ApiError(499, "client disconnected")
            if task.done():
                break
        try:
            yield task.result()
        except StopAsyncIteration:
            return
