"""Our load generator against AIPerf on the served config, interleaved (not a test).

Builds what is missing (cache hits otherwise), starts tritonserver on the repository ``serve`` and
``bench`` use (the serving pin applied to the serve copy where it matches), and alternates our client
and AIPerf at ``serve.tune.concurrency`` (default: the largest of ``serve.concurrency``), ours first
and last, both on AIPerf's route and both at ``--client-nice`` (:mod:`pipeline.serve.crosscheck`):
AIPerf / ours requests/s per round, their mean with its standard error and their range. No search:
``tune-serving --cross-check aiperf`` runs the same check on the config its search chose.

    .venv/bin/python benchmarks/aiperf_crosscheck.py recipes/int8-encoder.yaml --rounds 3
    .venv/bin/python benchmarks/aiperf_crosscheck.py recipes/fp8-llm.yaml --set serve.tune.concurrency=8
    .venv/bin/python benchmarks/aiperf_crosscheck.py recipes/int8-encoder.yaml --rounds 1 --client-nice 0

Writes ``<run dir>/cross_check/cross_check.json`` and ``.md`` (``cross_check_nice<N>/`` for another
``--client-nice``). Exit 4 when a run had request errors
or AIPerf failed (not a measurement), as ``bench``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", help="path to a recipe YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe field")
    parser.add_argument("--rounds", type=int, default=3, help="AIPerf runs, each between two of ours (default 3)")
    parser.add_argument("--client-nice", type=int, default=None, metavar="N",
                        help="both clients lower their CPU priority by N (AIPerf under nice -n N, our load threads "
                             "each by N); 0: neither (default: tune-serving's, pipeline.serve.crosscheck.CLIENT_NICE)")
    parser.add_argument("--no-serving-pin", action="store_true",
                        help="serve the recipe's own config (with its --set overrides), not the serving pin's")
    parser.add_argument("--quiet", action="store_true", help="no build progress output")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.client_nice is not None and not 0 <= args.client_nice <= 19:
        parser.error(f"--client-nice must be 0 to 19; got {args.client_nice}")

    from pipeline.errors import EXIT_ENVIRONMENT
    from pipeline.fsutil import write_json_atomic
    from pipeline.recipe.load import load_from_args
    from pipeline.serve import crosscheck, tune
    from pipeline.serve.bench import environment
    from pipeline.serve.prepare import built_artifacts
    from pipeline.serve.run import launch, prepare_for_server

    recipe = load_from_args(args)
    served = prepare_for_server(recipe, built_artifacts(recipe, Path(args.recipe), quiet=args.quiet),
                                Path(args.recipe), use_pin=not args.no_serving_pin)
    print(served.note)
    nice = crosscheck.CLIENT_NICE if args.client_nice is None else args.client_nice
    folder = served.run_dir / ("cross_check" if nice == crosscheck.CLIENT_NICE else f"cross_check_nice{nice}")
    sp = tune.space(served, cores=tune.cores_here(), max_instances=recipe.serve.tune.max_instances)
    with launch(served) as server:
        env = {**environment(server), "cpu_model": tune.cpu_model()}
        runner = tune.Runner(served, server, sp, tune.operating_point(recipe))
        result = crosscheck.cross_check(served, server, runner, rounds=args.rounds, folder=folder, nice=nice)
    result = {"recipe": recipe.name, "served_config": sp.default.label(), "environment": env, **result}
    md = [f"## AIPerf cross-check, {recipe.name}: tritonserver {env.get('tritonserver')}, {env.get('cpu_model')}, "
          f"{env.get('cpus')} CPUs", "", f"Served config: {sp.default.label()}.", "", *crosscheck.render(result)]
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "cross_check.json", result, strict=True)
    (folder / "cross_check.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"{folder / 'cross_check.json'}")
    if "failed" in result:
        print(f"cross-check failed: {result['failed']}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    return 0


if __name__ == "__main__":
    sys.exit(main())
