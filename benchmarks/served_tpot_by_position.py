"""TPOT near output positions 16 and 256 through a real tritonserver, several requests (not a test).

``make bench`` reads TPOT(256)/TPOT(16) as the median of a few long requests; on shared cores one request's
gaps move +-20 % over its life. This script starts tritonserver on a built serve repository
(``artifacts/<recipe>/serve_repository``, written by ``make bench`` / ``make serve``), loads only
``--models``, optionally runs 8 concurrent 32-token requests first (as the bench's sweep does),
then sends ``--requests`` streamed requests of 260 tokens (EOS ignored) one after another and
prints, per request, the median gap of 8 positions near 16 and near 256 and their ratio.

    .venv/bin/python benchmarks/served_tpot_by_position.py \\
        --repository artifacts/fp8-llm/serve_repository --models smollm2_generate smollm2_fp8 [--sweep-first]

Measured (fp8-llm, grouped-attention export, 29-GEMM FP8 set, 2 idle cores): only
smollm2_generate loaded: ratios 1.098, 0.891; with smollm2_fp8 too: 1.023, 1.106, then 1.028,
1.456, 1.111 (and 0.98 in a run whose other two were not kept); after a concurrency-8 sweep:
0.902, 0.881. Single requests spread 0.88-1.46 (median 1.03); the graph alone grows 1.06 and the generation model without the server 1.075,
so one request's ratio is mostly noise. The bench run of the same build read 1.40 from its one request;
the bench now takes the median of ``serve.long_requests`` (3) requests: 1.01 (single requests 0.87-1.23).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from pipeline.serve.client import StreamClient
    from pipeline.serve.stats import tpot_by_position
    from pipeline.triton.server import start_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository", type=Path, required=True)
    ap.add_argument("--models", nargs="+", required=True, help="the generation model first")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--sweep-first", action="store_true", help="8 concurrent 32-token requests before")
    args = ap.parse_args()
    model = args.models[0]
    prompt = list(range(100, 116))  # 16 token ids
    server = start_server([args.repository], models=args.models, explicit=True, timeout_s=600)
    try:
        def short() -> None:
            with StreamClient(server.grpc_url) as c:
                c.generate(model, input_ids=prompt, max_tokens=32, ignore_eos=True)

        if args.sweep_first:
            threads = [threading.Thread(target=short) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        gens = []
        for _ in range(args.requests):
            with StreamClient(server.grpc_url) as c:
                gens.append(c.generate(model, input_ids=prompt, max_tokens=260, ignore_eos=True))
        pos = tpot_by_position(gens, [16, 256])  # the bench's own computation
        rows = [{"tpot_ms": r["tpot_ms"], "ratio": round(r["ratio"], 3),
                 "gap_median_per_32_ms": [round(float(np.median(r["gaps_ms"][i:i + 32])), 1)
                                          for i in range(0, len(r["gaps_ms"]), 32)]} for r in pos["requests"]]
        print(f"median over requests: ratio {pos['ratio']:.3f} (single {pos['ratio_range'][0]:.3f}-"
              f"{pos['ratio_range'][1]:.3f})")
        print(json.dumps({"models": args.models, "sweep_first": args.sweep_first, "requests": rows}, indent=1))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
