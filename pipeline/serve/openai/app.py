"""OpenAI-compatible HTTP endpoint in front of the generation model (FastAPI + uvicorn).

Routes: ``GET /v1/models`` and ``GET /v1/models/{id}`` (with the served context,
``max_model_len``, as vLLM), ``GET /health`` (200 when Triton has the model ready, else 503),
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` = server-sent events
``data: {...}`` ending with ``data: [DONE]``), and at the root, as vLLM serves them and lm-eval's
remote tokenizer asks for them: ``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize``
(:func:`tokenizer_info`; the served tokenizer.json, so ids are the model's).
Each request is one gRPC stream to Triton (``tritonclient.grpc.aio``); a client that
disconnects cancels its Triton request. Request fields map to the generation model's
inputs (notes/genapi.md): ``prompt`` -> ``text_input`` (a string) or ``input_ids`` (a
list of token ids), ``messages`` -> ``messages`` (JSON), ``max_tokens`` /
``max_completion_tokens`` -> ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``seed``, ``stop`` and ``ignore_eos`` as named; ``echo`` + ``logprobs`` -> ``prompt_logprobs``
(the loglikelihood contract: :func:`completion_choice`), ``logprobs`` / chat ``top_logprobs`` ->
``logprobs``; a list of prompts is a batch (one Triton request and one choice each). What is
accepted and refused: pipeline.serve.openai.requests; the Triton side:
pipeline.serve.openai.bridge. A sampling input the served model does not have is refused (400) unless its value is the model's own default (greedy). Stop strings
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
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.errors import EnvironmentFault, PipelineError
from pipeline.serve.openai.bridge import (
    Run,
    TritonGenerator,
    _need,
    _strings,
    score_inputs,
    triton_inputs,
    unavailable,
)
from pipeline.serve.openai.requests import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Request,
    parse_request,
)
from pipeline.serve.openai.responses import chat_logprobs, completion_choice
from pipeline.sources.model import load_tokenizer

#: Environment variable read for the API key when ``--api-key`` is not given.
API_KEY_ENV = "PIPELINE_API_KEY"
#: OpenAI's default ``max_tokens`` for the legacy completions route.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


# --- token counts ----------------------------------------------------------------------------------------


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
                self._chat = load_tokenizer(self.folder)
            ids = self._chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        except Exception:  # no chat template / not loadable: usage then counts completion tokens only
            return None


def served_context(model_folder: Path) -> int | None:
    """The served context in tokens (prompt + generated): the generation model's ``max_context``
    parameter in ``<model_folder>/../config.pbtxt``; None when there is no such config or it is 0
    (unlimited)."""
    from pipeline.triton.config import parse_config

    path = model_folder.parent / "config.pbtxt"
    if not path.is_file():
        return None
    params = parse_config(path.read_text()).parameters
    value = params["max_context"].string_value if "max_context" in params else ""
    return int(value) if value.strip().isdigit() and int(value) > 0 else None


def tokenizer_info(model_folder: Path, max_model_len: int | None) -> dict[str, Any]:
    """``GET /tokenizer_info`` (vLLM's route, which lm-eval's remote tokenizer reads): the special
    tokens of ``tokenizer_config.json`` (``eos_token``, ``bos_token``, ``pad_token``, ``unk_token``;
    a string or None), the chat template (``chat_template.jinja``, else tokenizer_config.json's; None
    without one) and ``max_model_len`` (tokens; None: unlimited)."""
    path = model_folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    out: dict[str, Any] = {}
    for key in ("eos_token", "bos_token", "pad_token", "unk_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        out[key] = value if isinstance(value, str) else None
    jinja = model_folder / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else config.get("chat_template")
    if isinstance(template, list):  # [{name, template}]: "default" wins, as transformers picks it
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    out["chat_template"] = template if isinstance(template, str) else None
    out["max_model_len"] = max_model_len
    return out


# --- the app ---------------------------------------------------------------------------------------------


#: the endpoint's routes, as a 404 lists them
ROUTES = ("GET /v1/models", "GET /v1/models/{model}", "GET /health", "POST /v1/completions",
          "POST /v1/chat/completions", "GET /tokenizer_info", "POST /tokenize", "POST /detokenize")


@dataclass
class EndpointConfig:
    """What the endpoint serves. ``api_key``: None = no key checked (loopback only)."""

    grpc_url: str
    model: str
    model_folder: Path
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


class Endpoint:
    """One app's state: its config, the served tokenizer and what is read from it once
    (context, ``/tokenizer_info``, vocabulary size, the model card), and the Triton client
    (:class:`~pipeline.serve.openai.bridge.TritonGenerator`, opened by :func:`lifespan`).
    The routes reach it as ``request.app.state.endpoint``."""

    def __init__(self, cfg: EndpointConfig):
        self.cfg = cfg
        self.counter = TokenCounter(cfg.model_folder)
        self.context = served_context(cfg.model_folder)
        self.info = tokenizer_info(cfg.model_folder, self.context)
        self.vocab = self.counter.tokenizer.get_vocab_size(with_added_tokens=True)
        self.card = {"id": cfg.model, "object": "model", "created": cfg.created, "owned_by": "trt-pipeline",
                     "max_model_len": self.context}
        self.gen: TritonGenerator | None = None


def _endpoint(request: Request) -> Endpoint:
    return request.app.state.endpoint


def create_app(cfg: EndpointConfig):
    """The FastAPI application (see the module docstring for routes and errors): :data:`router`'s
    routes, the error handlers and the API-key check, on an :class:`Endpoint` for ``cfg``."""
    app = FastAPI(title="trt-pipeline OpenAI-compatible endpoint", lifespan=lifespan)
    app.state.endpoint = Endpoint(cfg)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.middleware("http")(check_key)
    app.include_router(router)
    return app


@asynccontextmanager
async def lifespan(app):
    """The Triton client for the app's life, and the :class:`Shutdown` its streams watch."""
    endpoint = app.state.endpoint
    endpoint.gen = TritonGenerator(endpoint.cfg.grpc_url, endpoint.cfg.model)
    app.state.shutdown = Shutdown(asyncio.get_running_loop())
    yield
    await endpoint.gen.close()


async def api_error(request: Request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status)


async def http_error(request: Request, exc: StarletteHTTPException):  # unknown route / method: OpenAI's shape
    what = {404: f"no route {request.url.path}; routes: {', '.join(ROUTES)}",
            405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    headers = getattr(exc, "headers", None)
    return JSONResponse(ApiError(exc.status_code, what).body(), status_code=exc.status_code, headers=headers)


async def internal_error(request: Request, exc: Exception):  # a bug: still OpenAI's error shape
    error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")
    return JSONResponse(error.body(), status_code=500)


async def check_key(request: Request, call_next):
    """401 unless the request carries the app's API key (when it has one)."""
    key = _endpoint(request).cfg.api_key
    if key is not None and not _key_ok(request.headers.get("authorization", ""), key):
        error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key")
        return JSONResponse(error.body(), status_code=401)
    return await call_next(request)


#: The endpoint's routes (:data:`ROUTES`); each reads its app's :class:`Endpoint`.
router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [_endpoint(request).card]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    endpoint = _endpoint(request)
    if model_id != endpoint.cfg.model:
        raise ApiError(404, f"model: '{model_id}' is not served here; GET /v1/models lists '{endpoint.cfg.model}'",
                       param="model", code="model_not_found")
    return endpoint.card


@router.get("/tokenizer_info")
async def tokenizer_info_route(request: Request):
    return _endpoint(request).info


@router.post("/tokenize")
async def tokenize(request: Request):
    endpoint = _endpoint(request)
    req = parse_request(TokenizeRequest, await _json(request))
    _check_model(req, endpoint.cfg.model)
    ids = endpoint.counter.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens).ids
    return {"tokens": ids, "count": len(ids), "max_model_len": endpoint.context}


@router.post("/detokenize")
async def detokenize(request: Request):
    endpoint = _endpoint(request)
    req = parse_request(DetokenizeRequest, await _json(request))
    _check_model(req, endpoint.cfg.model)
    if any(t >= endpoint.vocab for t in req.tokens):
        raise ApiError(400, f"tokens: token ids must be in [0, {endpoint.vocab}) (the served tokenizer's vocabulary); "
                            f"got {max(req.tokens)}", param="tokens")
    return {"prompt": endpoint.counter.tokenizer.decode(req.tokens, skip_special_tokens=False)}


@router.get("/health")
async def health(request: Request):
    endpoint = _endpoint(request)
    cfg = endpoint.cfg
    try:
        ready = await endpoint.gen.client.is_model_ready(cfg.model)
    except Exception as e:  # InferenceServerException: Triton unreachable
        raise unavailable(cfg.grpc_url, e) from e
    if not ready:
        raise ApiError(503, f"model {cfg.model} is not ready on the Triton server at {cfg.grpc_url}",
                       type_="service_unavailable", code="model_not_ready")
    return {"status": "ok", "model": cfg.model}


@router.post("/v1/completions")
async def completions(request: Request):
    endpoint = _endpoint(request)
    cfg, counter, gen = endpoint.cfg, endpoint.counter, endpoint.gen
    req = parse_request(CompletionRequest, await _json(request))
    _check_model(req, cfg.model)
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


@router.post("/v1/chat/completions")
async def chat(request: Request):
    endpoint = _endpoint(request)
    cfg, counter, gen = endpoint.cfg, endpoint.counter, endpoint.gen
    req = parse_request(ChatRequest, await _json(request))
    _check_model(req, cfg.model)
    supported = await gen.inputs()
    if "messages" not in supported:
        raise ApiError(400, f"messages: the served generation model {cfg.model} has no 'messages' input "
                            f"(inputs: {', '.join(sorted(supported))}); use /v1/completions", param="messages")
    messages = [m.for_template() for m in req.messages]
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


async def _all(request, runs: list[Run]) -> list[str]:
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


async def _json(request) -> Any:
    try:
        return await request.json()
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None


def _check_model(req: _Request | TokenizeRequest | DetokenizeRequest, model: str) -> None:
    """404 for a request naming another model (the tokenizer routes may leave ``model`` out)."""
    if req.model is not None and req.model != model:
        raise ApiError(404, f"model: '{req.model}' is not served here; GET /v1/models lists '{model}'",
                       param="model", code="model_not_found")


def _key_ok(header: str, key: str) -> bool:
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


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


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: a free port) and listening: the endpoint's, taken
    before tritonserver starts so that a busy port fails at once and no other server can take it
    meanwhile (connections wait in the backlog until uvicorn accepts them).

    Raises:
        PipelineError: ``port`` is not in 0-65535 (exit 2).
        EnvironmentFault: the address cannot be bound (in use, or not this machine's).
    """
    if not 0 <= port <= 65535:
        raise PipelineError(f"--openai-port {port}: a TCP port is 1-65535 (0: a free port)")
    address = host.strip("[]")  # an IPv6 address may come as in a URL, [::1]
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise EnvironmentFault(f"--host {host} --openai-port {port}: cannot bind ({e}); pick a free port, or "
                               "--openai-port 0 for any (make serve ARGS='--openai-port 0')") from e
    return sock


class EndpointServer:
    """uvicorn serving :func:`create_app` in a background thread, on ``sock`` (from
    :func:`bind_socket`) or else on a socket it binds to ``host``:``port``.

        with EndpointServer(cfg, host="127.0.0.1", port=0) as ep:   # port 0: a free port
            print(ep.url)   # http://127.0.0.1:PORT/v1

    Raises:
        EnvironmentFault: ``host``:``port`` cannot be bound.
    """

    def __init__(self, cfg: EndpointConfig, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 sock: socket.socket | None = None):
        import uvicorn

        self.host = host.strip("[]")
        self.socket = sock if sock is not None else bind_socket(host, port)
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
