"""Served TPOT at concurrency 1: int4-llm against fp8-llm on one tritonserver, interleaved (not a test).

Issue 37 asks for "``make bench --no-aiperf`` TPOT at concurrency 1 against fp8-llm's". ``make bench``
runs each recipe on its own server at its own time, so on shared cores its two TPOTs are not side by
side. This script builds what is missing of both recipes (cache hits otherwise), prepares the serve
copies ``serve`` / ``bench`` use (:func:`pipeline.serve.run.prepare_for_server`: python-onnxruntime
on the wheel's server, the serving pin applied where it matches), starts one tritonserver per recipe
(:func:`pipeline.serve.run.launch`; both stay up, the idle one costs no CPU, and two repositories
in one server would hold fp8-llm's models twice), and alternates: each round sends ``--requests`` streamed generations to fp8-llm's
generation model, one at a time (concurrency 1), then as many to int4-llm's, each of
``serve.max_tokens`` tokens with EOS ignored, from the validate stage's first prompt
(:func:`pipeline.serve.bench.llm_prompts`; both recipes share the tokenizer and the prompt).

TPOT of one generation: its mean gap between streamed tokens after the first (ms,
:attr:`pipeline.serve.client.Generation.tpot_ms`); a round's TPOT: the median over its requests.
Reported: each recipe's TPOT per round, the per-round ratio fp8 / int4 (> 1: int4 is faster), its
mean with the standard error over rounds and its range, TTFT medians, and the 1-min load average at
start and end. One uncounted warm-up generation per model first.

    .venv/bin/python benchmarks/int4_served_tpot.py [--rounds 5] [--requests 4]
        [--json benchmarks/results/int4_served_tpot.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPES = ("fp8-llm", "int4-llm")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=4, help="generations per recipe per round")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "int4_served_tpot.json")
    args = ap.parse_args()
    if args.rounds < 2 or args.requests < 1:
        ap.error("--rounds >= 2 (a standard error) and --requests >= 1")

    from pipeline.recipe.load import load_recipe
    from pipeline.serve.bench import environment, llm_prompts
    from pipeline.serve.client import StreamClient
    from pipeline.serve.prepare import built_artifacts
    from pipeline.serve.run import prepare_for_server
    from pipeline.serve.run import launch
    from pipeline.serve.tune import cpu_model

    served = {}
    for name in RECIPES:
        path = ROOT / "recipes" / f"{name}.yaml"
        recipe = load_recipe(path)
        served[name] = prepare_for_server(recipe, built_artifacts(recipe, path, quiet=True), path)
        print(served[name].note)
    prompt = llm_prompts(served["fp8-llm"])[0]
    max_tokens = served["fp8-llm"].recipe.serve.max_tokens
    models = {n: str(s.generate_model) for n, s in served.items()}
    load = [os.getloadavg()[0]]
    rounds: list[dict] = []
    with launch(served["fp8-llm"]) as fp8_server, launch(served["int4-llm"]) as int4_server:
        servers = {"fp8-llm": fp8_server, "int4-llm": int4_server}
        env = {**environment(fp8_server), "cpu_model": cpu_model()}
        clients = {n: StreamClient(servers[n].grpc_url) for n in RECIPES}
        try:
            for name in RECIPES:  # warm-up, not counted
                clients[name].generate(models[name], input_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
            for r in range(args.rounds):
                row: dict = {}
                for name in RECIPES:
                    gens = [clients[name].generate(models[name], input_ids=prompt, max_tokens=max_tokens,
                                                   ignore_eos=True) for _ in range(args.requests)]
                    row[name] = {"tpot_ms": float(np.median([g.tpot_ms for g in gens])),
                                 "ttft_ms": float(np.median([g.ttft_ms for g in gens])),
                                 "tokens": [len(g.tokens) for g in gens]}
                row["ratio"] = row["fp8-llm"]["tpot_ms"] / row["int4-llm"]["tpot_ms"]
                rounds.append(row)
                print(f"round {r + 1}: TPOT fp8-llm {row['fp8-llm']['tpot_ms']:.1f} ms, int4-llm "
                      f"{row['int4-llm']['tpot_ms']:.1f} ms, fp8 / int4 {row['ratio']:.3f}", flush=True)
        finally:
            for c in clients.values():
                c.close()
    load.append(os.getloadavg()[0])
    ratios = [r["ratio"] for r in rounds]
    summary = {"ratio_mean": float(np.mean(ratios)), "ratio_stderr": float(np.std(ratios, ddof=1) / math.sqrt(len(ratios))),
               "ratio_min": min(ratios), "ratio_max": max(ratios),
               **{f"{n}_tpot_ms_median": float(np.median([r[n]["tpot_ms"] for r in rounds])) for n in RECIPES},
               **{f"{n}_ttft_ms_median": float(np.median([r[n]["ttft_ms"] for r in rounds])) for n in RECIPES}}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "environment": env, "loadavg_1m": load, "max_tokens": max_tokens, "prompt_tokens": len(prompt),
              "requests_per_round": args.requests, "served": {n: s.note for n, s in served.items()},
              "rounds": rounds, "summary": summary}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"served TPOT at concurrency 1 (median over rounds): fp8-llm {summary['fp8-llm_tpot_ms_median']:.1f} ms, "
          f"int4-llm {summary['int4-llm_tpot_ms_median']:.1f} ms; fp8 / int4 {summary['ratio_mean']:.3f} "
          f"+- {summary['ratio_stderr']:.3f} (range {summary['ratio_min']:.3f}-{summary['ratio_max']:.3f}, "
          f"{len(rounds)} rounds); load average {load[0]:.2f} -> {load[1]:.2f}")
    print(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
