"""OpenAI-compatible HTTP endpoint in front of the generation model (FastAPI + uvicorn).

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (200 when Triton has the
model ready, else 503), ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` = server-sent events ``data: {...}`` ending with ``data: [DONE]``).
Each request is one gRPC stream to Triton (``tritonclient.grpc.aio``); a client that
disconnects cancels its Triton request. Request fields map to the generation model's
inputs (notes/genapi.md): ``prompt`` -> ``text_input`` (a string) or ``input_ids`` (a
list of token ids), ``messages`` -> ``messages`` (JSON), ``max_tokens`` /
``max_completion_tokens`` -> ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``seed``, ``stop`` and ``ignore_eos`` as named; ``echo`` + ``logprobs`` -> ``prompt_logprobs``
(the loglikelihood contract: :func:`completion_choice`), ``logprobs`` / chat ``top_logprobs`` ->
``logprobs``; a list of prompts is a batch (one Triton request and one choice each). What is
accepted and refused: pipeline.serve.openai_requests. A sampling input the served model does not
have is refused (400) unless its value is the model's own default (greedy). Stop strings
are also applied here, so they work with a model that lacks the ``stop`` input.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 bad input
(``param`` names the field), 401 missing / wrong API key, 404 unknown model, 503 Triton
unreachable.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.errors import EnvironmentFault, PipelineError
from pipeline.serve.openai_requests import (  # noqa: F401  (re-exported: the endpoint's request API)
    ApiError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    _Request,
    parse_request,
)

API_KEY_ENV = "PIPELINE_API_KEY"
#: OpenAI's default ``max_tokens`` for the legacy completions route.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
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


# --- stop strings and token counts -----------------------------------------------------------------------


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


def find_model_folder(repository: Path, model: str) -> Path:
    """``<repository>/<model>/<highest numeric version>`` (where tokenizer.json is).

    Raises:
        PipelineError: no version folder with a tokenizer.json.
    """
    versions = sorted((p for p in (repository / model).glob("*") if p.name.isdigit() and
                       (p / "tokenizer.json").is_file()), key=lambda p: int(p.name))
    if not versions:
        raise PipelineError(f"{repository / model}: no version folder with a tokenizer.json; "
                            "is this the generation model of a built repository?")
    return versions[-1]


class TokenCounter:
    """Prompt token counts for ``usage``, with the tokenizer the model uses."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.folder = folder
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._chat = None

    def text(self, prompt: str) -> list[int]:
        """The prompt's token ids (the served tokenizer.json; special tokens as it adds them)."""
        return self.tokenizer.encode(prompt).ids

    def chat(self, messages: list[dict]) -> list[int] | None:
        """Token ids of the chat-template prompt (add_generation_prompt); None without a template."""
        try:
            if self._chat is None:
                from transformers import AutoTokenizer

                self._chat = AutoTokenizer.from_pretrained(str(self.folder))
            ids = self._chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        except Exception:  # no chat template / not loadable: usage then counts completion tokens only
            return None


# --- the app ---------------------------------------------------------------------------------------------


#: the endpoint's routes, as a 404 lists them
ROUTES = ("GET /v1/models", "GET /v1/models/{model}", "GET /health", "POST /v1/completions",
          "POST /v1/chat/completions")


@dataclass
class EndpointConfig:
    """What the endpoint serves. ``api_key``: None = no key checked (loopback only)."""

    grpc_url: str
    model: str
    model_folder: Path
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(cfg: EndpointConfig):
    """The FastAPI application (see the module docstring for routes and errors)."""
    counter = TokenCounter(cfg.model_folder)
    state: dict[str, TritonGenerator] = {}

    @asynccontextmanager
    async def lifespan(app):
        state["gen"] = TritonGenerator(cfg.grpc_url, cfg.model)
        app.state.shutdown = Shutdown(asyncio.get_running_loop())
        yield
        await state["gen"].close()

    app = FastAPI(title="trt-pipeline OpenAI-compatible endpoint", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unknown route / method: OpenAI's shape
        what = {404: f"no route {request.url.path}; routes: {', '.join(ROUTES)}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        headers = getattr(exc, "headers", None)
        return JSONResponse(ApiError(exc.status_code, what).body(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # a bug: still OpenAI's error shape
        error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if cfg.api_key is not None and not _key_ok(request.headers.get("authorization", ""), cfg.api_key):
            error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            return JSONResponse(error.body(), status_code=401)
        return await call_next(request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model, "object": "model", "created": cfg.created,
                                            "owned_by": "trt-pipeline"}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != cfg.model:
            raise ApiError(404, f"model: '{model_id}' is not served here; GET /v1/models lists '{cfg.model}'",
                           param="model", code="model_not_found")
        return {"id": cfg.model, "object": "model", "created": cfg.created, "owned_by": "trt-pipeline"}

    @app.get("/health")
    async def health():
        gen = state["gen"]
        try:
            ready = await gen.client.is_model_ready(cfg.model)
        except Exception as e:  # InferenceServerException: Triton unreachable
            raise unavailable(cfg.grpc_url, e) from e
        if not ready:
            raise ApiError(503, f"model {cfg.model} is not ready on the Triton server at {cfg.grpc_url}",
                           type_="service_unavailable", code="model_not_ready")
        return {"status": "ok", "model": cfg.model}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await _json(request))
        _check_model(req, cfg.model)
        gen = state["gen"]
        supported = await gen.inputs()
        runs = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                inputs = {"text_input": _strings([prompt])}
                prompt_ids: list[int] | None = counter.text(prompt)
            else:
                inputs = {"input_ids": np.asarray(prompt, np.int64)}
                prompt_ids = list(prompt)
            inputs.update(triton_inputs(req, supported, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS))
            inputs.update(score_inputs(req, supported))
            runs.append(Run(gen, inputs, req, prompt_ids, kind="text_completion", model=cfg.model))
        if req.stream:  # one prompt (parse_request refuses a streamed batch)
            return await runs[0].respond(request, JSONResponse, ClosingStreamingResponse)
        texts = await _all(request, runs)
        choices = [completion_choice(counter.tokenizer, req, prompt, run, text, i)
                   for i, (prompt, run, text) in enumerate(zip(req.prompts(), runs, texts))]
        usage = {k: sum(r.usage()[k] for r in runs) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return JSONResponse({"id": runs[0].id, "object": "text_completion", "created": runs[0].created,
                             "model": cfg.model, "choices": choices, "usage": usage})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse_request(ChatRequest, await _json(request))
        _check_model(req, cfg.model)
        gen = state["gen"]
        supported = await gen.inputs()
        if "messages" not in supported:
            raise ApiError(400, f"messages: the served generation model {cfg.model} has no 'messages' input "
                                f"(inputs: {', '.join(sorted(supported))}); use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        inputs = {"messages": _strings([json.dumps(messages)])}
        inputs.update(triton_inputs(req, supported, default_max_tokens=None))
        if req.logprobs:
            _need(supported, "logprobs", "logprobs")
            inputs["logprobs"] = np.array([req.top_logprobs or 0], np.int32)
        run = Run(gen, inputs, req, counter.chat(messages), kind="chat.completion", model=cfg.model)
        if req.stream:
            return await run.respond(request, JSONResponse, ClosingStreamingResponse)
        text = await run.text(request)
        logprobs = chat_logprobs(counter.tokenizer, run) if req.logprobs else None
        return JSONResponse(run._whole(text, logprobs))

    return app


async def _all(request, runs: list["Run"]) -> list[str]:
    """Each run's whole text, run concurrently; the first error cancels the others.

    Raises:
        ApiError: the first run's error (in prompt order).
    """
    tasks = [asyncio.ensure_future(r.text(request)) for r in runs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()
    return [t.result() for t in tasks]


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


def token_strings(tokenizer, ids: list[int], window: int = 6, context: Sequence[int] = ()) -> list[str]:
    """Each token's text as it adds to the decoded text (special tokens kept): the decode of a
    few tokens before it and itself, less the decode of those before it. ``context``: the ids
    before ``ids[0]`` (the prompt's, for generated tokens): a Metaspace word-initial token then
    keeps its space, as in the completion's text."""
    out = []
    head_ids = list(context)[-window:]
    seq = head_ids + list(ids)
    for i in range(len(head_ids), len(seq)):
        before = seq[max(0, i - window):i]
        head = tokenizer.decode(before, skip_special_tokens=False)
        whole = tokenizer.decode(before + [seq[i]], skip_special_tokens=False)
        out.append(whole[len(head):] if whole.startswith(head) else tokenizer.decode([seq[i]], skip_special_tokens=False))
    return out


def _top_dict(tokenizer, top: list | None, token: int, text: str) -> dict | None:
    if top is None:
        return None
    return {(text if i == token else tokenizer.decode([i], skip_special_tokens=False)): lp for i, lp in top}


def completion_choice(tokenizer, req: CompletionRequest, prompt, run: "Run", text: str, index: int) -> dict:
    """One choice of a (non-streamed) completion: with ``echo`` the prompt's text comes first;
    ``logprobs`` {tokens, token_logprobs, top_logprobs, text_offset} covers the prompt tokens
    (echo; the first one's logprob is null) then the generated ones. ``text_offset`` indexes the
    tokens' decoded texts (special tokens kept) from the start of the choice's text."""
    echo_text = ""
    if req.echo:
        echo_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)
    logprobs = None
    if req.logprobs is not None:
        prompt_scores = run.prompt_scores if req.echo else None
        ids = (prompt_scores["ids"] if prompt_scores else []) + run.tokens
        values = (prompt_scores["logprobs"] if prompt_scores else []) + [t["logprob"] for t in run.token_scores]
        tops = (prompt_scores["top"] if prompt_scores else []) + [t["top"] for t in run.token_scores]
        strings = token_strings(tokenizer, ids, context=() if prompt_scores else (run.prompt_ids or ()))
        offsets, at = [], 0
        for piece in strings:
            offsets.append(at)
            at += len(piece)
        logprobs = {"tokens": strings, "token_logprobs": values,
                    "top_logprobs": [_top_dict(tokenizer, t, i, s) for t, i, s in zip(tops, ids, strings)],
                    "text_offset": offsets}
    return run._choice(echo_text + text, run.finish_reason, delta=False, index=index, logprobs=logprobs)


def chat_logprobs(tokenizer, run: "Run") -> dict:
    """OpenAI's chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]} per generated token."""
    strings = token_strings(tokenizer, run.tokens, context=run.prompt_ids or ())
    content = []
    for token, text, score in zip(run.tokens, strings, run.token_scores):
        top = _top_dict(tokenizer, score["top"], token, text) or {}
        content.append({"token": text, "logprob": score["logprob"], "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top.items()]})
    return {"content": content}


async def _json(request) -> Any:
    try:
        return await request.json()
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None


def _check_model(req: _Request, model: str) -> None:
    if req.model != model:
        raise ApiError(404, f"model: '{req.model}' is not served here; GET /v1/models lists '{model}'",
                       param="model", code="model_not_found")


def _key_ok(header: str, key: str) -> bool:
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


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
        text = first + "".join([p async for p in _until_disconnect(request, pieces)])
        return json_response(self._whole(text))

    async def text(self, request) -> str:
        """The whole generated text (sets ``tokens``, ``finish_reason`` and the scores)."""
        return "".join([p async for p in _until_disconnect(request, self.pieces())])

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


#: The event a stream open at shutdown ends with (OpenAI's error shape), before ``data: [DONE]``.
SHUTDOWN_ERROR = ApiError(503, "the server is shutting down; this generation was stopped", type_="server_error",
                          code="server_shutdown")


class Shutdown:
    """The app's streams and the signal that ends them: :meth:`EndpointServer.stop` calls
    :meth:`end_streams` from another thread; each open stream then sends :data:`SHUTDOWN_ERROR`
    and ``data: [DONE]`` and closes (which cancels its Triton request)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.event, self.open = loop, asyncio.Event(), 0

    def end_streams(self, timeout_s: float) -> int:
        """Signal every open stream to end; wait up to ``timeout_s`` for them. Returns how many were open."""
        was_open = self.open
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop has already closed: no stream is open
            return 0
        deadline = time.monotonic() + timeout_s
        while self.open and time.monotonic() < deadline:
            time.sleep(0.02)
        return was_open

    async def until_set(self, body: AsyncIterator) -> AsyncIterator:
        """``body``'s chunks until it ends or shutdown is signalled; then the error event and [DONE]."""
        self.open += 1
        stop, chunk = asyncio.ensure_future(self.event.wait()), None
        try:
            while True:
                chunk = asyncio.ensure_future(body.__anext__())
                await asyncio.wait({chunk, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not chunk.done():
                    await _cancelled(chunk)  # the body's finally cancels its Triton request
                    yield f"data: {json.dumps(SHUTDOWN_ERROR.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                try:
                    yield chunk.result()
                except StopAsyncIteration:
                    return
        finally:  # also when the response is cancelled (a client disconnect): end the body's step first
            stop.cancel()
            if chunk is not None and not chunk.done():
                with anyio.CancelScope(shield=True):
                    await _cancelled(chunk)
            self.open -= 1


async def _cancelled(task: asyncio.Future) -> None:
    """Cancel ``task`` and wait until it has ended."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that closes its body iterator however the response ends, and ends
    the stream with an error event when the endpoint shuts down (:class:`Shutdown`).

    Starlette stops iterating when the client disconnects but leaves the suspended generator to
    the garbage collector when the disconnect lands while a chunk is being sent; closing it here
    runs the generator's ``finally`` (which cancels the Triton request) at once.
    """

    async def __call__(self, scope, receive, send) -> None:
        shutdown = getattr(getattr(scope.get("app"), "state", None), "shutdown", None)
        body = self.body_iterator
        if isinstance(shutdown, Shutdown):
            self.body_iterator = shutdown.until_set(body)
        try:
            await super().__call__(scope, receive, send)
        finally:
            for it in dict.fromkeys([self.body_iterator, body]):  # the wrapper first, then the body itself
                closer = getattr(it, "aclose", None)
                if closer is not None:
                    with anyio.CancelScope(shield=True):
                        await closer()


async def _until_disconnect(request, pieces: AsyncIterator[str], poll_s: float = 0.5) -> AsyncIterator[str]:
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


# --- binding and running ---------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: may resolve to any interface


def resolve_api_key(host: str, api_key: str | None, environ: dict | None = None) -> str | None:
    """The API key to check (``api_key``, else env ``PIPELINE_API_KEY``), None for none.

    Raises:
        PipelineError: (exit 2) ``host`` is not loopback and there is no key.
    """
    env = os.environ if environ is None else environ
    key = api_key or env.get(API_KEY_ENV) or None
    if key is None and not is_loopback(host):
        raise PipelineError(f"--host {host}: binding the OpenAI endpoint to a non-loopback address needs an API key; "
                            f"pass --api-key KEY or set {API_KEY_ENV} (or bind 127.0.0.1)")
    return key


class EndpointServer:
    """uvicorn serving :func:`create_app` in a background thread.

        with EndpointServer(cfg, host="127.0.0.1", port=0) as ep:   # port 0: a free port
            print(ep.url)   # http://127.0.0.1:PORT/v1
    """

    def __init__(self, cfg: EndpointConfig, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as e:
            self.socket.close()
            raise EnvironmentFault(f"--host {host} --openai-port {port}: cannot bind ({e}); pick a free port") from e
        self.port = self.socket.getsockname()[1]
        self.app = create_app(cfg)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="openai-endpoint", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> "EndpointServer":
        """Start serving; returns once uvicorn accepts connections.

        Raises:
            EnvironmentFault: not started within ``timeout_s`` (or it exited).
        """
        if self.server.started:
            return self
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise EnvironmentFault(f"the OpenAI endpoint on {self.url} did not start within {timeout_s:.0f}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """End open streams with :data:`SHUTDOWN_ERROR` (:class:`Shutdown`), ask uvicorn to exit
        (other open requests get ``timeout_graceful_shutdown``), then join."""
        shutdown = getattr(self.app.state, "shutdown", None)
        if shutdown is not None and self.thread.is_alive():
            shutdown.end_streams(timeout_s / 2)
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        self.socket.close()

    def __enter__(self) -> "EndpointServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
