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
import signal
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.manifest import write_json_atomic
from pipeline.recipe import Recipe
from pipeline.serve import bench as B
from pipeline.serve.check import PromptCheck, check_greedy
from pipeline.serve.prepare import Served, prepare, write_variants
from pipeline.serve.report import render
from pipeline.triton.server import TritonServer, TritonServerError, find_server, start_server

Log = Callable[[str], None]


def prepare_for_server(recipe: Recipe, artifacts: dict) -> Served:
    """:func:`pipeline.serve.prepare.prepare` for the backends of the installed tritonserver."""
    return prepare(recipe, artifacts, find_server().backends)


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


def serve_forever(served: Served, *, check: bool = False, log: Log = print) -> int:
    """Serve in the foreground until Ctrl-C / SIGTERM; returns the server's exit code.

    Raises:
        TritonServerError: it did not start, or exited on its own (log tail included).
    """
    log(served.note)
    server = launch(served)
    # Installed explicitly: a SIGINT disposition inherited as "ignored" (some
    # launchers and test runners pass that on) would otherwise make Ctrl-C a no-op.
    old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _print_endpoints(served, server, log)
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
        for sig, handler in old.items():
            signal.signal(sig, handler)
        code = server.stop()
    return code


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _print_endpoints(served: Served, server: TritonServer, log: Log) -> None:
    log(f"tritonserver ready: HTTP http://{server.http_url}  gRPC {server.grpc_url}  "
        f"metrics http://127.0.0.1:{server.metrics_port}/metrics")
    log(f"models: {', '.join(served.models)} (repository {served.repository}; log {server.log_path})")
    if served.generate_model:
        log(f"try: curl -s http://{server.http_url}/v2/models/{served.compute_model}/config | head; "
            f"stream {served.generate_model} with tritonclient.grpc (decoupled)")


def bench(served: Served, *, log: Log = print) -> dict:
    """Start the server, run the sweeps of the recipe's model kind and the batching
    comparison, stop it; write ``bench.json`` and ``bench.md`` into ``<run dir>/bench/``.

    Returns the result dict (``markdown``: the printed tables).

    Raises:
        TritonServerError, ServeClientError: the server failed or answered with an error.
    """
    variants = write_variants(served)
    log(served.note)
    result: dict = {"recipe": served.recipe.name, "serve": served.recipe.serve.model_dump(mode="json"),
                    "generated_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "served": {"repository": str(served.repository), "target": served.target, "note": served.note,
                               "models": served.models}}
    with launch(served, extra_repositories=[v.repository for v in variants]) as server:
        result["environment"] = B.environment(server)
        if served.generate_model:
            result["llm"] = B.bench_llm(served, server, log)
        elif served.ensemble_model:
            result["encoder"] = B.bench_encoder(served, server, log)
        result["batching"] = (B.bench_variants(served, server, variants, log) if variants
                              else {"skipped": "max_batch_size is 0: Triton cannot batch this model"})
    result["markdown"] = render(result)
    _write(served.run_dir / "bench", result)
    return result


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

