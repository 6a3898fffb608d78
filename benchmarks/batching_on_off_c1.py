"""Concurrency 1 with continuous batching on vs off, interleaved (not a test).

Both do one sequence per step at concurrency 1, so their TPOT should match; this checks that
a gap seen in a bench (levels measured minutes apart) is load, not the scheduler. Loads the
generation model twice without tritonserver (benchmarks/generate_scheduler.py's stand-in),
in-process ONNX Runtime, and alternates one request on each, ``--rounds`` times.

    .venv/bin/python benchmarks/batching_on_off_c1.py artifacts/fp8-llm/serve_repository/smollm2_fp8/1/model.onnx \\
        artifacts/fp8-llm/serve_repository/smollm2_generate/1 --dequantize
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_scheduler import PROMPTS, install_pb_utils, load_model, request, run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("onnx", type=Path)
    parser.add_argument("tokenizer", type=Path)
    parser.add_argument("--dequantize", action="store_true")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    install_pb_utils()
    from tokenizers import Tokenizer

    prompt = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")).encode(PROMPTS[0]).ids
    tpot: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        models = {"on": load_model(args.onnx, args.tokenizer, Path(a), 8, args.dequantize, continuous=True),
                  "off": load_model(args.onnx, args.tokenizer, Path(b), 8, args.dequantize, continuous=False)}
        for name, model in models.items():  # warm-up
            run(model, request(prompt, 2))
        for _ in range(args.rounds):
            for name, model in models.items():
                one, = run(model, request(prompt, args.tokens))
                tpot[name].append(float(np.median(np.diff(one.times())) * 1e3))
        for model in models.values():
            model.finalize()
    out = {k: {"tpot_ms_median": float(np.median(v)), "tpot_ms": [round(x, 1) for x in v]} for k, v in tpot.items()}
    out["on_over_off"] = out["on"]["tpot_ms_median"] / out["off"]["tpot_ms_median"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
