"""Time to first token through the OpenAI endpoint and straight to Triton over gRPC, side by side
(not a test): what the endpoint's SSE hop adds.

One tritonserver and the endpoint (pipeline.serve.run.launch / start_endpoint). The same prompt
(token ids) and output length go alternately through both paths, one request at a time, ``--requests``
times each after a warm-up: gRPC with one :class:`pipeline.serve.client.StreamClient`
(TTFT = send to first token), the endpoint with one keep-alive ``httpx`` client streaming
``/v1/completions`` (TTFT = send to the first SSE event carrying text). Prints the medians, the
median of the paired differences and the per-token gap medians, as JSON.

    .venv/bin/python benchmarks/endpoint_ttft.py --recipe recipes/fp8-llm.yaml   # a built recipe
    .venv/bin/python benchmarks/endpoint_ttft.py --tiny                         # the tests' tiny LM
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def served_from(args, work: Path):
    """(Served, prompt ids): the recipe's finished run, or the tests' tiny LM in ``work``."""
    if args.tiny:
        from pipeline.serve.prepare import prepare
        from serve_tiny import context_build, llm_artifacts, llm_recipe

        served = prepare(llm_recipe(work), llm_artifacts(work, build=context_build(512)), backends=["python"])
        return served, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6]
    from pipeline.recipe.load import load_recipe
    from pipeline.serve.bench import llm_prompts
    from pipeline.serve.prepare import built_artifacts
    from pipeline.serve.run import prepare_for_server

    recipe = load_recipe(Path(args.recipe), {})
    served = prepare_for_server(recipe, built_artifacts(recipe, Path(args.recipe), quiet=True))
    return served, llm_prompts(served)[0]


def sse_request(http, url: str, model: str, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    """(TTFT ms, gaps between text events ms) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True}
    start, times = time.perf_counter(), []
    with http.stream("POST", f"{url}/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.perf_counter())
    return (times[0] - start) * 1e3, list(np.diff(times) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--recipe", help="a recipe whose build passed, e.g. recipes/fp8-llm.yaml")
    source.add_argument("--tiny", action="store_true", help="the tests' tiny LM (tests/serve_tiny.py)")
    parser.add_argument("--requests", type=int, default=24, help="requests per path (>= 20)")
    parser.add_argument("--tokens", type=int, default=8, help="output tokens per request")
    args = parser.parse_args()
    import httpx

    from pipeline.serve.client import StreamClient
    from pipeline.serve.run import launch, start_endpoint

    with tempfile.TemporaryDirectory() as work:
        served, prompt = served_from(args, Path(work))
        model = str(served.generate_model)
        ttft: dict[str, list[float]] = {"grpc": [], "openai": []}
        gaps: dict[str, list[float]] = {"grpc": [], "openai": []}
        with launch(served) as server, start_endpoint(served, server, port=0) as endpoint, \
                StreamClient(server.grpc_url) as grpc, httpx.Client(timeout=600) as http:
            for i in range(args.requests + 2):  # two warm-up rounds, then alternate the paths
                gen = grpc.generate(model, input_ids=prompt, max_tokens=args.tokens, ignore_eos=True)
                first, hop = sse_request(http, endpoint.url, model, prompt, args.tokens)
                if i >= 2:
                    ttft["grpc"].append(gen.ttft_ms)
                    gaps["grpc"] += gen.gaps_ms
                    ttft["openai"].append(first)
                    gaps["openai"] += hop
    diff = np.subtract(ttft["openai"], ttft["grpc"])
    print(json.dumps({
        "model": model, "target": served.target, "prompt_tokens": len(prompt), "output_tokens": args.tokens,
        "requests_per_path": args.requests, "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
        "ttft_ms_median": {k: round(float(np.median(v)), 2) for k, v in ttft.items()},
        "openai_minus_grpc_ttft_ms": {"median": round(float(np.median(diff)), 2),
                                      "p25": round(float(np.percentile(diff, 25)), 2),
                                      "p75": round(float(np.percentile(diff, 75)), 2)},
        "token_gap_ms_median": {k: round(float(np.median(v)), 2) for k, v in gaps.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
