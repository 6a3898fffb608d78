"""Command line: ``python -m pipeline build recipes/fp8-llm.yaml``.

Commands: ``build`` (every stage; ``--test``: on a random 2-layer copy of the model,
gates not enforced, nothing published, see pipeline.run.smoke), ``check`` (the build's pre-flight only: schema,
cross-section constraints and the weights' presence), ``serve`` (local
tritonserver until Ctrl-C), ``bench`` (start, measure, stop; see pipeline.serve)
and ``verify-repo DIR`` (re-hash a published repository against its repository.json).

``--set KEY=VALUE`` overrides one recipe field for this run. KEY is a dotted path;
list items are addressed by index (``build.profiles.0.dims.batch.max=16``). VALUE
is read as YAML (``0.5``, ``true``, ``[1, 8]``, ``{min: 1, opt: 4, max: 8}``); where it
is not valid YAML it is taken as the plain string (``*mlp*``), and a bracketed list
that is not valid YAML as a list of plain strings (``[*mlp*, *attn*]``). The schema
then decides whether the value fits.

Exit codes (pipeline.errors):

* 0: passed.
* 1: an accuracy gate failed, or an accuracy budget is unreachable.
* 2: bad input: the recipe (file, key path and YAML line), a ``--set`` value, a
  data or model file, a pinned tuning result (file and JSON path).
* 3: internal error: one console line naming the exception and the file holding
  the traceback: ``<work_dir>/<recipe name>/error.log`` once the recipe was read,
  else ``./pipeline-error.log``. Also a native crash of the TensorRT(-RTX) builder (its child
  process died of a signal; ``build --bisect-crash`` reduces the graph to what still crashes).
* 4: environment: lock held, server failed to start, storage or network error (any
  ENOSPC, EDQUOT, EROFS or EXDEV, under whatever error it surfaced as, names the
  folder), out of memory (a MemoryError, ENOMEM or an allocator failure: names the stage, its
  peak resident memory and this machine's; or the engine builder's child process SIGKILLed), a
  published repository that fails verification.
  The kernel's OOM killer ends the process with SIGKILL, which no program can catch: the
  shell then reports 137 (``make``: ``Error 137``).
* 130: interrupted (Ctrl-C / SIGTERM); finished stages are kept.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from pipeline import interrupts
from pipeline.memory import memory_fault
from pipeline.errors import (
    EXIT_BAD_INPUT,
    EXIT_ENVIRONMENT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    PipelineError,
    RecipeError,
    RepositoryCorrupt,
    storage_fault,
)
from pipeline.recipe.load import load_from_args, parse_set
from pipeline.recipe.precisions import CALIBRATED
from pipeline.run.preflight import check_pin_folder, preflight, refuse_matched_sets

FALLBACK_LOG = Path("pipeline-error.log")
BISECT_DEFAULT_S = 600.0  # build --bisect-crash's time limit


def cmd_build(args) -> int:
    from pipeline.remote.cache import RemoteCache
    from pipeline.run.runner import run_pipeline

    remote = RemoteCache.from_url(getattr(args, "cache", None))  # a bad URL fails before any work (exit 2)
    recipe, _ = preflight(args)
    if getattr(args, "test", False):  # random 2-layer copy, gates not enforced (pipeline.run.smoke)
        from pipeline.run.smoke import run_test

        return run_test(Path(args.recipe), recipe, parse_set(args.set), quiet=args.quiet)
    result = run_pipeline(recipe, Path(args.recipe), quiet=args.quiet, locked=getattr(args, "locked", False),
                          remote=remote,
                          bisect_crash_s=args.bisect_time_limit if getattr(args, "bisect_crash", False) else None)
    run_dir = result.manifest_path.parent
    for g in result.manifest["gates"]:
        print(g["message"])
    if not result.manifest["gates"]:
        from pipeline.run.report import NO_GATES

        print(NO_GATES)
    print(f"manifest: {result.manifest_path}\nreport:   {run_dir / 'report.md'}\njunit:    {run_dir / 'junit.xml'}")
    if not result.passed:
        print(f"accuracy gate failed; see {run_dir / 'report.md'}", file=sys.stderr)
        return 1
    print(f"model repository: {recipe.output_dir}/")
    return 0


def cmd_tune(args) -> int:
    """Export (cached), calibrate and search anew, then write the pinned result
    (:mod:`pipeline.quant.pin`) beside the recipe. Exit 1 when the budget is unreachable.

    Raises:
        RecipeError: (exit 2, before any work) a precision with nothing to pin; a ``--set`` that
            changes what the pin matches (the pin would match only that command line); the pin
            folder cannot be written (names it; a read-only file system is exit 4).
    """
    import shutil

    from pipeline.quant import pin
    from pipeline.run.runner import run_tune

    recipe, _ = preflight(args)
    if recipe.quantize.precision not in CALIBRATED or recipe.quantize.calibration is None:
        raise RecipeError(f"{args.recipe}: quantize.precision {recipe.quantize.precision!r} has no calibration "
                          f"or search to pin; tune applies to {' and '.join(CALIBRATED)} recipes")
    dest = pin.pin_path(args.recipe, recipe.name)
    refuse_matched_sets(args, recipe, dest)
    check_pin_folder(dest)
    art, cand = run_tune(recipe, Path(args.recipe), quiet=args.quiet)
    data = pin.read(cand)  # what is pinned must read back as a valid pin, before it replaces one
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".json.tmp")
    shutil.copyfile(cand, tmp)
    tmp.replace(dest)
    found = data.get("metrics") or {}
    gemms = len(art.quantized_nodes) + len(art.excluded_nodes)
    print(f"pinned: {dest} ({len(art.excluded_nodes)} of {gemms} GEMMs in high precision, {len(data['amax'])} amax"
          + (", " + ", ".join(f"{k} {v:.6g}" for k, v in found.items()) if found else "") + ")")
    print(f"quantized graph: {art.onnx_path}; commit {dest} so every runner builds this graph")
    return 0


def cmd_check(args) -> int:
    recipe, weights = preflight(args)
    print(f"{args.recipe}: valid recipe {recipe.name!r} (sha256 {recipe.digest[:12]}); weights: {weights}")
    return 0


def _served(args, recipe=None):
    from pipeline.serve.prepare import built_artifacts
    from pipeline.serve.run import prepare_for_server

    recipe = recipe or load_from_args(args)
    return prepare_for_server(recipe, built_artifacts(recipe, Path(args.recipe), quiet=args.quiet), Path(args.recipe))


def cmd_serve(args) -> int:
    from pipeline.serve.openai.app import resolve_api_key
    from pipeline.serve.prepare import generate_model_of
    from pipeline.serve.run import endpoint_socket, serve_forever

    recipe = load_from_args(args)
    generates = generate_model_of(recipe) is not None  # else no endpoint: its flags are said to be unused
    api_key = resolve_api_key(args.host, args.api_key) if generates else None  # off loopback, no key: before any build
    sock = endpoint_socket(args.host, args.openai_port) if generates else None  # busy: before any build
    try:
        code = serve_forever(_served(args, recipe), check=args.check, host=args.host, openai_port=args.openai_port,
                             api_key=api_key, sock=sock)
    finally:
        if sock is not None:
            sock.close()
    print(f"tritonserver stopped (exit status {code})")
    return 0 if code == 0 else EXIT_ENVIRONMENT


def cmd_bench(args) -> int:
    from pipeline.serve.run import bench, failures, slo_failures

    served = _served(args)
    result = bench(served, aiperf=not args.no_aiperf, greedy=not args.no_greedy)
    print(result["markdown"])
    print(f"bench: {served.run_dir / 'bench' / 'bench.json'}\n       {served.run_dir / 'bench' / 'bench.md'}")
    bad, missed = failures(result), slo_failures(result)
    if bad:  # served tokens left validate's beyond a near tie: what is served is not what was validated
        print("served greedy tokens differ from the validate stage's:\n  " + "\n  ".join(bad), file=sys.stderr)
    if missed:  # serve.slo.gate: CI fails on goodput
        print("SLO gate failed (serve.slo.gate):\n  " + "\n  ".join(missed), file=sys.stderr)
    if bad or missed:
        return 1
    if aiperf_failed := result.get("llm", {}).get("aiperf", {}).get("failed"):  # asked for, and did not run
        print(f"bench: {aiperf_failed} (--no-aiperf skips AIPerf)", file=sys.stderr)
        return EXIT_ENVIRONMENT
    return 0


def cmd_verify_repo(args) -> int:
    """Re-hash a published repository against its repository.json.

    Raises:
        RepositoryCorrupt: any file differs, is missing or is half-published (exit 4);
            the message lists every problem.
    """
    from pipeline.triton.publish import read_index, verify_repository

    repo = Path(args.dir)
    if not repo.is_dir():
        raise PipelineError(f"verify-repo: {repo} is not a directory")
    problems = verify_repository(repo)
    if problems:
        listed = "\n".join(f"  {p}" for p in problems)
        raise RepositoryCorrupt(f"{repo}: {len(problems)} problem(s) against repository.json:\n{listed}")
    print(f"verified: {repo} ({len(read_index(repo))} models)")
    return 0


#: name, function, help, arguments: "recipe" (recipe + --set / --quiet), "dir", or
#: "module:function" that adds the command's own arguments (the command lives in that module).
COMMANDS = (
    ("build", "cmd_build", "run the pipeline for a recipe", "recipe"),
    ("tune", "cmd_tune", "calibrate and run the accuracy-budget search anew; pin the result in recipes/tuned/",
     "recipe"),
    ("tune-serving", "cmd_tune_serving", "measure candidate Triton configs on a real tritonserver against "
     "serve.slo; pin the best in recipes/tuned/<name>.serving.json", "pipeline.serve.tune:add_tune_serving_arguments"),
    ("check", "cmd_check", "the build's pre-flight only: recipe schema and constraints, weights", "recipe"),
    ("serve", "cmd_serve", "serve the recipe's repository on a local tritonserver until Ctrl-C", "recipe"),
    ("bench", "cmd_bench", "start tritonserver, measure latency / throughput / batching, stop", "recipe"),
    ("verify-repo", "cmd_verify_repo", "re-hash a published model repository against its repository.json", "dir"),
    ("publish", "cmd_publish", "upload the recipe's validated models to S3 as a new Triton version, then make it live",
     "pipeline.remote.s3:add_publish_arguments"),
    ("deploy", "cmd_deploy", "write Kubernetes manifests (KServe InferenceService, or Deployment + Service + HPA)",
     "pipeline.remote.k8s:add_deploy_arguments"),
    ("plan-build", "cmd_plan_build", "write a cluster build plan: an Argo Workflow, Kubernetes Jobs and CI snippets "
     "(CPU stages once, one engine per GPU SKU)", "pipeline.remote.plan:add_plan_build_arguments"),
    ("plan-step", "cmd_plan_step", "run one step of a plan-build plan (cpu, gpu --sku S, assemble) in its own folder",
     "pipeline.remote.plan:add_plan_step_arguments"),
    ("plan", "cmd_plan", "GPU capacity plan (weights, KV cache, roofline, replicas) from the built model's numbers",
     "pipeline.plan.capacity:add_plan_arguments"),
)


def _external(spec: str, name: str):
    """The function ``name`` of the module in ``spec`` ("module:function")."""
    import importlib

    return getattr(importlib.import_module(spec.partition(":")[0]), name)


def _add_recipe_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("recipe", help="path to a recipe YAML, e.g. recipes/fp8-llm.yaml")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe field by dotted path (list items by index), e.g. "
                         "serve.concurrency=[1,2] or build.profiles.0.dims.batch.max=16 (repeatable)")
    sp.add_argument("--quiet", action="store_true", help="no build progress output")


def _plain(text: str) -> str:
    """``text`` without reStructuredText's inline-literal double backticks (for ``--help``)."""
    return text.replace("``", "")


def _prog() -> str:
    """The command as the user typed it: ``trtpipe`` (the console script) or ``python -m pipeline``."""
    return "trtpipe" if Path(sys.argv[0]).stem == "trtpipe" else "python -m pipeline"


def build_parser() -> argparse.ArgumentParser:
    prog = _prog()
    description = _plain(__doc__.splitlines()[0]).replace("python -m pipeline", prog)
    p = argparse.ArgumentParser(prog=prog, description=description)
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, help_, positional in COMMANDS:
        sp = sub.add_parser(name, help=help_)
        if ":" in positional:
            _external(positional, positional.partition(":")[2])(sp)
            sp.set_defaults(fn=_external(positional, fn))
            if not any(a.dest == "recipe" for a in sp._actions):  # the module relies on the common ones
                _add_recipe_arguments(sp)
            continue
        sp.set_defaults(fn=globals()[fn])
        if positional == "dir":
            sp.add_argument("dir", help="a published Triton model repository, e.g. model_repository")
            continue
        _add_recipe_arguments(sp)
        if name == "serve":
            from pipeline.serve.run import add_serve_arguments

            sp.add_argument("--check", action="store_true",
                            help="stream every validate prompt and compare with the validate stage's greedy tokens")
            add_serve_arguments(sp)
        if name == "build":
            sp.add_argument("--locked", action="store_true",
                            help="CI: never run the accuracy-budget search; exit 2 when the recipe's pinned tuning "
                                 "result (recipes/tuned/<name>.json) is missing or stale, naming what changed")
            sp.add_argument("--cache", metavar="s3://BUCKET/PREFIX",
                            help="stage cache shared by runners (default: $PIPELINE_CACHE; none: local only): "
                                 "pull verified stages whose key is there, push the ones run here")
            sp.add_argument("--bisect-crash", action="store_true",
                            help="when the TensorRT builder crashes (a signal in its child process), reduce the "
                                 "graph to the smallest subgraph that still crashes; saved with its node names under "
                                 "<work_dir>/<name>/build/crash/")
            sp.add_argument("--bisect-time-limit", type=float, default=BISECT_DEFAULT_S, metavar="SECONDS",
                            help=f"how long --bisect-crash may build candidates (default {BISECT_DEFAULT_S:.0f})")
            sp.add_argument("--test", action="store_true",
                            help="smoke test: run on a randomly initialised 2-layer copy of the model (HF folder "
                                 "or GGUF sources only); gates reported, not enforced; nothing published")
        if name == "bench":
            sp.add_argument("--no-aiperf", action="store_true", help="skip the AIPerf run against the OpenAI endpoint")
            sp.add_argument("--no-greedy", action="store_true",
                            help="skip the openai-client comparison of served and validate greedy tokens")
    return p


def _error_log(args) -> Path:
    """Where an internal error's traceback goes (see the module docstring)."""
    recipe = getattr(args, "loaded_recipe", None)
    return Path(recipe.work_dir) / recipe.name / "error.log" if recipe is not None else FALLBACK_LOG


def _internal_error(args, exc: BaseException) -> int:
    """Save the traceback, print one line naming the exception and the log; exit 3."""
    text = "".join(traceback.format_exception(exc))
    where = "not saved"
    for log in dict.fromkeys([_error_log(args), FALLBACK_LOG]):
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(f"{_prog()} {' '.join(getattr(args, 'argv', []))}\n{text}", errors="backslashreplace")
            where = f"traceback in {log}"
            break
        except OSError:
            continue
    lines = str(exc).splitlines() or [""]
    if isinstance(exc, PipelineError):  # our own message, written for people: all of it (a builder crash's ways around)
        print(f"internal error: {type(exc).__name__}: {lines[0]} ({where}; please report it)", *lines[1:],
              sep="\n", file=sys.stderr)
    else:
        print(f"internal error: {type(exc).__name__}: {lines[0][:300]} ({where}; please report it)", file=sys.stderr)
    return EXIT_INTERNAL


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (see the module docstring). Libraries'
    tqdm bars are off (each step prints its own timed line); ``TQDM_DISABLE=`` (empty) shows them."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # read when tqdm is imported, which comes later
    for stream in (sys.stdout, sys.stderr):  # a message naming a non-UTF-8 path must print, not crash the handler
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with interrupts.handled():  # the one place SIGINT/SIGTERM handlers are installed
            return args.fn(args)
    except PipelineError as e:
        if e.exit_code in (EXIT_BAD_INPUT, EXIT_INTERNAL) and storage_fault(e) is not None:
            return _storage_error(e)
        if e.exit_code == EXIT_INTERNAL:
            return _oom_error(e) or _internal_error(args, e)
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted: finished stages are kept; the next run resumes after them", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug: exit 3, traceback to a file, one line on the console
        if storage_fault(e) is not None:  # unless the file system refused a write: exit 4
            return _storage_error(e)
        return _oom_error(e) or _internal_error(args, e)  # or memory ran out: exit 4
    except SystemExit as e:  # sys.exit() in a library or a model's forward: its code would read as ours
        err = RuntimeError(f"sys.exit({e.code!r}) was called inside the command (by a library or the model's code)")
        err.__cause__ = e
        return _internal_error(args, err)


def _oom_error(exc: BaseException) -> int | None:
    """Print an allocation failure under ``exc`` (:func:`pipeline.memory.memory_fault`); its exit
    code (4), or None when ``exc`` is not one."""
    oom = memory_fault(exc)
    if oom is None:
        return None
    print(f"error: {oom}", file=sys.stderr)
    return oom.exit_code


def _storage_error(exc: BaseException) -> int:
    """A full / read-only / cross-device file system under any other error: exit 4."""
    fault = storage_fault(exc)
    first = str(exc).splitlines()[0] if str(exc) and not isinstance(exc, OSError) else ""
    print(f"error: {fault}" + (f"\n  (while: {first[:300]})" if first else ""), file=sys.stderr)
    return fault.exit_code


if __name__ == "__main__":
    sys.exit(main())
