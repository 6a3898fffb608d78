"""Command line: ``python -m pipeline build recipes/fp8-llm.yaml``.

Also ``check`` (recipe only), ``serve`` (local tritonserver until Ctrl-C) and
``bench`` (start, measure, stop; see pipeline.serve).

Exit codes: 0 success, 1 an accuracy gate failed, 2 bad input or a failed stage.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from pipeline.errors import PipelineError


def _parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise PipelineError(f"--set {item!r}: expected KEY=VALUE, e.g. validate.gates.max_relative_perplexity_increase=0.01")
        out[key] = yaml.safe_load(value)
    return out


def cmd_build(args) -> int:
    from pipeline.recipe import load_recipe
    from pipeline.runner import run_pipeline

    recipe = load_recipe(args.recipe, _parse_set(args.set))
    result = run_pipeline(recipe, Path(args.recipe), quiet=args.quiet)
    run_dir = result.manifest_path.parent
    for g in result.manifest["gates"]:
        print(g["message"])
    print(f"manifest: {result.manifest_path}\nreport:   {run_dir / 'report.md'}\njunit:    {run_dir / 'junit.xml'}")
    if not result.passed:
        print(f"accuracy gate failed; see {run_dir / 'report.md'}", file=sys.stderr)
        return 1
    print(f"model repository: {recipe.output_dir}/")
    return 0


def cmd_check(args) -> int:
    from pipeline.recipe import load_recipe

    from pipeline.models.llm import package_file

    recipe = load_recipe(args.recipe, _parse_set(args.set))
    weights = package_file(recipe.model)  # raises, naming model.package/path, when missing
    print(f"{args.recipe}: valid recipe {recipe.name!r} (sha256 {recipe.digest[:12]}); weights: {weights}")
    return 0


def _served(args):
    from pipeline.recipe import load_recipe
    from pipeline.serve.prepare import built_artifacts
    from pipeline.serve.run import prepare_for_server

    recipe = load_recipe(args.recipe, _parse_set(args.set))
    return prepare_for_server(recipe, built_artifacts(recipe, Path(args.recipe), quiet=args.quiet))


def cmd_serve(args) -> int:
    from pipeline.serve.run import serve_forever

    code = serve_forever(_served(args), check=args.check)
    print(f"tritonserver stopped (exit status {code})")
    return 0 if code == 0 else 2


def cmd_bench(args) -> int:
    from pipeline.serve.run import bench

    served = _served(args)
    result = bench(served)
    print(result["markdown"])
    print(f"bench: {served.run_dir / 'bench' / 'bench.json'}\n       {served.run_dir / 'bench' / 'bench.md'}")
    return 0


COMMANDS = (
    ("build", "cmd_build", "run the pipeline for a recipe"),
    ("check", "cmd_check", "validate a recipe (schema and weights) and exit"),
    ("serve", "cmd_serve", "serve the recipe's repository on a local tritonserver until Ctrl-C"),
    ("bench", "cmd_bench", "start tritonserver, measure latency / throughput / batching, stop"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, help_ in COMMANDS:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("recipe", help="path to a recipe YAML, e.g. recipes/fp8-llm.yaml")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe field by dotted path, e.g. serve.concurrency=[1,2] (repeatable)")
        sp.add_argument("--quiet", action="store_true", help="no build progress output")
        if name == "serve":
            sp.add_argument("--check", action="store_true",
                            help="stream every validate prompt and compare with the validate stage's greedy tokens")
        sp.set_defaults(fn=globals()[fn])
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted: finished stages are kept; the next run resumes after them", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
