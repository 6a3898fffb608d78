"""``serve`` and ``bench``: the code path shared by the CLI, the Makefile and Python callers.

    served = prepare_for_server(recipe, artifacts)   # artifacts of a finished run
    result = bench(served)                           # starts, measures, stops

The server is :func:`pipeline.triton.server.start_server` (127.0.0.1, free
ports, readiness wait, clean stop with no process or shared memory left); its
log stays in ``<work_dir>/<recipe>/server/<pid>/tritonserver.log`` (one folder
per process, so a ``serve`` and a ``bench`` of one recipe can run at once).
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import write_json_atomic
from pipeline.recipe.schema import Recipe
from pipeline.serve import bench as B
from pipeline.serve.check import PromptCheck, check_greedy
from pipeline.serve.openai.app import (
    API_KEY_ENV,
    EndpointConfig,
    EndpointServer,
    bind_socket,
    find_model_folder,
    resolve_api_key,
)
from pipeline.serve.prepare import Served, prepare, write_variants
from pipeline.serve.report import PLOT_FILE, render, write_plot
from pipeline.triton.server import TritonServer, TritonServerError, find_server, start_server

Log = Callable[[str], None]
#: Default port of the OpenAI-compatible endpoint (``serve --openai-port``).
DEFAULT_OPENAI_PORT = 8000


def prepare_for_server(recipe: Recipe, artifacts: dict, recipe_path: Path | None = None, *,
                       use_pin: bool = True) -> Served:
    """:func:`pipeline.serve.prepare.prepare` for the backends of the installed tritonserver (with
    the serving pin beside ``recipe_path`` for a serve copy)."""
    return prepare(recipe, artifacts, find_server().backends, recipe_path=recipe_path, use_pin=use_pin)


def launch(served: Served, *, extra_repositories: list[Path] | None = None) -> TritonServer:
    """Start tritonserver on ``served`` (and ``extra_repositories``) and wait until the served
    models are ready. Explicit model control: only they load (a shared output_dir may hold
    other recipes' models); the client loads and unloads the others.

    Raises:
        TritonServerError: it exited or was not ready within ``serve.ready_timeout_s``.
    """
    return start_server([served.repository, *(extra_repositories or [])], models=served.models, explicit=True,
                        timeout_s=served.recipe.serve.ready_timeout_s,
                        workdir=served.run_dir / "server" / str(os.getpid()))


def add_serve_arguments(parser) -> None:
    """``serve``'s OpenAI-endpoint flags: ``--host``, ``--openai-port``, ``--api-key``."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the OpenAI-compatible endpoint binds (default 127.0.0.1); any non-loopback "
                             f"address needs an API key (--api-key or env {API_KEY_ENV})")
    parser.add_argument("--openai-port", type=int, default=DEFAULT_OPENAI_PORT,
                        help=f"port of the OpenAI-compatible endpoint (default {DEFAULT_OPENAI_PORT}; 0: a free port)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every request (default: env {API_KEY_ENV})")


def serve_forever(served: Served, *, check: bool = False, log: Log = print, host: str = "127.0.0.1",
                  openai_port: int | None = None, api_key: str | None = None, sock: socket.socket | None = None) -> int:
    """Serve in the foreground until Ctrl-C / SIGTERM; returns the server's exit code.

    For a generation model the OpenAI-compatible endpoint (:mod:`pipeline.serve.openai.app`)
    runs in front of Triton on ``host``:``openai_port`` (default
    :data:`DEFAULT_OPENAI_PORT`; 0 = a free port). ``api_key`` (else env ``PIPELINE_API_KEY``)
    is checked as ``Authorization: Bearer``; it is required for a non-loopback ``host``. ``sock``:
    the endpoint's socket, already bound (:func:`endpoint_socket`; closed here), else bound here.

    Raises:
        PipelineError: (exit 2) non-loopback ``host`` without an API key, checked before
            anything starts.
        TritonServerError: it did not start, or exited on its own (log tail included).
        EnvironmentFault: the endpoint's port cannot be bound, checked before tritonserver starts.
    """
    if not served.generate_model and (openai_port not in (None, DEFAULT_OPENAI_PORT) or host != "127.0.0.1"
                                      or api_key):
        log("note: this recipe has no generation model, so no OpenAI endpoint: --host, --openai-port and "
            "--api-key are not used")
        host, api_key = "127.0.0.1", None
    key = resolve_api_key(host, api_key)
    if sock is None and served.generate_model:
        sock = endpoint_socket(host, openai_port)  # a busy port fails before tritonserver starts
    try:
        return _serve(served, sock, check=check, log=log, host=host, key=key)
    finally:
        if sock is not None:
            sock.close()


def endpoint_socket(host: str, openai_port: int | None) -> socket.socket:
    """The OpenAI endpoint's socket on ``host``:``openai_port`` (None: :data:`DEFAULT_OPENAI_PORT`),
    bound and listening (:func:`pipeline.serve.openai.app.bind_socket`, whose errors it raises)."""
    return bind_socket(host, DEFAULT_OPENAI_PORT if openai_port is None else openai_port)


def _serve(served: Served, sock: socket.socket | None, *, check: bool, log: Log, host: str, key: str | None) -> int:
    """:func:`serve_forever` once the endpoint's socket (None: no generation model) is bound."""
    log(served.note)
    server = launch(served)
    endpoint: EndpointServer | None = None
    try:  # Ctrl-C / SIGTERM: KeyboardInterrupt from the CLI's handler (pipeline.interrupts)
        _print_endpoints(served, server, log)
        if served.generate_model:
            endpoint = start_endpoint(served, server, host=host, api_key=key, sock=sock)
            log(f"OpenAI-compatible endpoint: {endpoint.url} (model {served.generate_model}; "
                f"{'API key required' if key else 'no API key'})")
            log(f"tokenizer folder: {find_model_folder(served.repository, served.generate_model)} (AIPerf's "
                f"--tokenizer; lm-eval's local-completions finds {endpoint.url.removesuffix('/v1')}/tokenizer_info, "
                "/tokenize and /detokenize itself)")
        if check and not served.generate_model:
            log("check: this recipe has no generation model; nothing to compare")
        elif check:
            for c in check_greedy(served, server.grpc_url):
                log(f"check: prompt {c.index}: {c.verdict}")
        log("serving; Ctrl-C stops the server")
        while server.process.poll() is None:
            time.sleep(0.5)
        raise TritonServerError(f"tritonserver exited with status {server.process.returncode}:\n{server.logs()[-3000:]}")
    except KeyboardInterrupt:
        log("stopping tritonserver ...")
    finally:
        if endpoint is not None:
            endpoint.stop()
        code = server.stop()
    return code


def start_endpoint(served: Served, server: TritonServer, *, host: str = "127.0.0.1", port: int | None = None,
                   api_key: str | None = None, sock: socket.socket | None = None) -> EndpointServer:
    """Start the OpenAI-compatible endpoint for ``served``'s generation model on a running server,
    on ``sock`` (:func:`pipeline.serve.openai.app.bind_socket`) if given, else on ``host``:``port``.

    Raises:
        PipelineError: no generation model, or non-loopback ``host`` without ``api_key``.
        EnvironmentFault: the port cannot be bound, or uvicorn did not start.
    """
    if not served.generate_model:
        raise PipelineError(f"{served.recipe.name}: no generation model; the OpenAI endpoint serves causal LMs only")
    cfg = EndpointConfig(grpc_url=server.grpc_url, model=served.generate_model,
                         model_folder=find_model_folder(served.repository, served.generate_model),
                         api_key=resolve_api_key(host, api_key))
    return EndpointServer(cfg, host=host, port=DEFAULT_OPENAI_PORT if port is None else port, sock=sock).start()


def _print_endpoints(served: Served, server: TritonServer, log: Log) -> None:
    log(f"tritonserver ready: HTTP http://{server.http_url}  gRPC {server.grpc_url}  "
        f"metrics http://127.0.0.1:{server.metrics_port}/metrics")
    log(f"models: {', '.join(served.models)} (repository {served.repository}; log {server.log_path})")
    if served.generate_model:
        log(f"try: curl -s http://{server.http_url}/v2/models/{served.compute_model}/config | head; "
            f"stream {served.generate_model} with tritonclient.grpc (decoupled)")


def bench(served: Served, *, log: Log = print, aiperf: bool = True, greedy: bool = True) -> dict:
    """Start the server, run the sweeps of the recipe's model kind and the batching
    comparison, stop it; write ``bench.json``, ``bench.md`` and (LLM) the latency-vs-throughput
    plot ``latency_throughput.png`` into ``<run dir>/bench/``. LLM: the sweep runs with
    continuous batching on (``llm.levels``) and off (``llm.levels_static``) when the recipe
    has ``triton.continuous_batching``; with ``greedy`` (and validate greedy tokens) the ``openai``
    client sends the validate prompts at temperature 0 at each concurrency (``llm.client_agreement``:
    token agreement with validate's, echo-logprob perplexity; :func:`failures` lists mismatches);
    with ``aiperf`` (and the ``aiperf`` CLI installed) AIPerf also drives the OpenAI endpoint
    (``llm.aiperf``).

    Returns the result dict (``markdown``: the printed tables).

    Raises:
        TritonServerError, ServeClientError: the server failed or answered with an error.
    """
    variants = write_variants(served)
    static = B.write_static_variant(served)
    extra = [v.repository for v in variants] + ([static.repository] if static else [])
    log(served.note)
    result: dict = {"recipe": served.recipe.name, "serve": served.recipe.serve.model_dump(mode="json"),
                    "generated_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "served": {"repository": str(served.repository), "target": served.target, "note": served.note,
                               "models": served.models}}
    with launch(served, extra_repositories=extra) as server:
        result["environment"] = B.environment(server)
        if served.generate_model:
            result["llm"] = B.bench_llm(served, server, log, static)
            with start_endpoint(served, server, port=0) as endpoint:
                if greedy:
                    result["llm"]["client_agreement"] = B.bench_client_agreement(served, endpoint.url, log)
                if aiperf:
                    result["llm"]["aiperf"] = B.bench_aiperf(served, endpoint.url, served.run_dir / "bench" / "aiperf",
                                                             log)
        elif served.ensemble_model:
            result["encoder"] = B.bench_encoder(served, server, log)
        result["batching"] = (B.bench_variants(served, server, variants, log) if variants
                              else {"skipped": "max_batch_size is 0: Triton cannot batch this model"})
    if "llm" in result:
        result["llm"]["plot"] = write_plot(result["llm"], served.run_dir / "bench" / PLOT_FILE)
    gate = slo_gate(result, served.recipe)
    if gate is not None:
        result["slo_gate"] = gate
    result["markdown"] = render(result)
    _write(served.run_dir / "bench", result)
    return result


def slo_gate(result: dict, recipe) -> dict | None:
    """With ``serve.slo.gate``: the verdict on the served configuration's concurrency levels
    (an LLM's ``levels``, or ``levels_static`` when the recipe serves with
    ``triton.continuous_batching: false``; an encoder's ``levels``): ``{"min_met", "levels",
    "passed", "failures"}``, one failure line per level whose fraction of requests meeting
    ``serve.slo`` (``slo_met``) is below ``serve.slo.min_met``. None when the gate is off."""
    slo = recipe.serve.slo
    if not slo.gate:
        return None
    llm = result.get("llm") or {}
    if llm:
        static = getattr(recipe.triton, "continuous_batching", True) is False and "levels_static" in llm
        which = "llm.levels_static" if static else "llm.levels"
        levels = llm["levels_static" if static else "levels"]
        bounds = f"TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms"
    else:
        which, levels = "encoder.levels", (result.get("encoder") or {}).get("levels", [])
        bounds = f"latency <= {slo.latency_ms:g} ms"
    failed = [f"concurrency {lv['concurrency']}: {100 * lv['slo_met']:.0f} % of requests met the SLO ({bounds}), "
              f"below serve.slo.min_met {100 * slo.min_met:g} % (goodput {lv['goodput_rps']:.2f} req/s)"
              for lv in levels if lv.get("slo_met") is None or lv["slo_met"] < slo.min_met]
    if not levels:
        failed = [f"no concurrency level was measured ({which}): the SLO gate has nothing to pass on"]
    return {"min_met": slo.min_met, "levels": which, "passed": not failed, "failures": failed}


def slo_failures(result: dict) -> list[str]:
    """The SLO gate's failure lines of a bench result (:func:`slo_gate`); empty when it passed or was off."""
    return list((result.get("slo_gate") or {}).get("failures") or [])


def failures(result: dict) -> list[str]:
    """One line per prompt whose tokens through the OpenAI endpoint (bench's client agreement)
    left the validate stage's greedy tokens beyond the near-tie tolerance; empty: none."""
    rows = result.get("llm", {}).get("client_agreement", {}).get("failures", [])
    return [f"concurrency {f['concurrency']}: prompt {f['prompt']}: {f['verdict']}" for f in rows]


def _write(folder: Path, result: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "bench.json", {k: v for k, v in result.items() if k != "markdown"}, strict=True)
    (folder / "bench.md").write_text(result["markdown"])


def check(served: Served, prompts: list[int] | None = None) -> list[PromptCheck]:
    """Start the server, run :func:`pipeline.serve.check.check_greedy`, stop it.

    Raises:
        PipelineError: no generation model; TritonServerError / ServeClientError as above.
    """
    if not served.generate_model:
        raise PipelineError(f"{served.recipe.name}: no generation model to check")
    with launch(served) as server:
        return check_greedy(served, server.grpc_url, prompts)

