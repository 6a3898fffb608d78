"""``python -m pipeline build`` in a process of its own that can be killed, without paying the
interpreter's imports for each one: a multiprocessing fork server imports the pipeline once,
and each run is a fresh fork of it (a process of its own, with its own pid, files and locks,
killed as any other). The crash tests run a dozen builds that SIGKILL themselves."""
from __future__ import annotations

import multiprocessing
import os
import sys
from dataclasses import dataclass
from pathlib import Path

#: imported once by the fork server (the CLI, the stages and what a tiny LLM build calls, including
#: the transformers modules its lazy loader imports on first use: 1.5 s less per build)
PRELOAD = ["pipeline.cli.app", "pipeline.run.runner", "pipeline.stages.export", "pipeline.stages.quantize",
           "pipeline.stages.build", "pipeline.stages.validate", "pipeline.stages.triton",
           "pipeline.models.text_generation.adapter", "torch.onnx", "transformers", "onnxruntime",
           "transformers.models.auto.tokenization_auto", "transformers.models.llama.configuration_llama",
           "transformers.activations", "crash_warm"]


@dataclass
class Finished:
    returncode: int  # as subprocess's: -N when killed by signal N
    stderr: str


def _build(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)  # the caller's whole environment, not the fork server's
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for stream in (1, 2):
        os.dup2(fd, stream)
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
    from pipeline.cli.app import main

    sys.exit(main(argv))


def run_build(argv: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: float = 600) -> Finished:
    """``python -m pipeline <argv>`` in ``cwd``, with this process's environment plus ``env``, in a
    fork of the fork server; its stdout and stderr go to ``log``. The build is killed when it runs
    past ``timeout`` seconds (TimeoutError) or when anything interrupts the wait."""
    log.parent.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    proc = ctx.Process(target=_build, args=(argv, {**os.environ, **env}, str(cwd), str(log)))
    proc.start()
    try:
        proc.join(timeout)
        if proc.exitcode is None:
            raise TimeoutError(f"pipeline {' '.join(argv)} ran past {timeout} s")
    finally:
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    return Finished(proc.exitcode, log.read_text() if log.exists() else "")
