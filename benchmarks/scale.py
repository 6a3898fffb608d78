"""The pipeline's cost against model size (issue 24 §2): random-weight Llama-family models
of about 135 M, 0.5 B and 1.1 B parameters, each built by fp8-llm's recipe (export,
calibration and the accuracy-budget search, the TensorRT-RTX build, validate, triton) and, with
``--precisions int4-awq``, by int4-llm's with INT4 weights rounded from FP32 after AWQ
(``quantize.weights: {method: awq, block_size: 64}``: 64 divides every size's hidden and
intermediate K; fp8-llm's calibration section; engines for sm86/sm89/sm120, INT4's targets).

Shapes: SmolLM2-135M's (576 hidden, 30 layers, GQA 9/3, tied embeddings), a 0.5 B
Llama (1536 hidden, 16 layers, GQA 12/4, tied) and TinyLlama-1.1B's (2048 hidden,
22 layers, GQA 32/4, untied), all with the SmolLM2 tokenizer (49152 tokens), so
the 1.1 B one has 1.17 B parameters. Weights are random (seed 0): accuracy means
nothing here, so each recipe's gates are replaced by "perplexity within 10x", which
only says the numbers are finite; the validate split is cut to 8 windows.

Each build is a fresh ``python -m pipeline build`` process; a watchdog samples the
resident set of its process tree every 0.5 s and stops it above ``--limit-gib``
(default 21: this machine has 24), reporting the stage it was in. Prints per model
and stage the wall time (s) and peak RSS (GiB, from the manifest) against the FP32
weight bytes, the fp8 search's trial count and time, AWQ's time by phase (the quantize stage's
``calibration.awq.seconds``), the engine bytes against the FP32 weight bytes, then the cost curve:
each total against parameters, with the log-log slope between neighbours of one precision (1.0 = linear).

    .venv/bin/python benchmarks/scale.py [--sizes 135m,0.5b,1.1b] [--precisions fp8,int4-awq]
                                         [--limit-gib 21] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

#: name -> LlamaConfig fields (vocabulary and tokens from the SmolLM2 tokenizer)
SIZES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=4, tie_word_embeddings=True),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, tie_word_embeddings=False),
}
STAGES = ("export", "quantize", "build", "validate", "triton")
#: precision row -> the shipped recipe it starts from
BASES = {"fp8": "fp8-llm", "int4-awq": "int4-llm"}
#: INT4 weights per scale along K for the int4-awq rows: divides every size's hidden and intermediate size
INT4_BLOCK = 64


def make_model(size: str, folder: Path) -> tuple[Path, int]:
    """The random-weight model ``size`` saved in ``folder`` (safetensors); returns (folder, parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny import smollm2_tokenizer

    tok = smollm2_tokenizer(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, **SIZES[size])
    model = LlamaForCausalLM(cfg).eval()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    return folder, params


def scale_recipe(bases: dict[str, dict], size: str, precision: str, model_dir: Path, ws: Path) -> dict:
    """The recipe (a dict, as loaded from YAML) building the random ``size`` model in ``model_dir``
    at ``precision`` (a key of :data:`BASES`), working under ``ws``.

    ``bases``: shipped recipe name -> its loaded YAML (fp8-llm's always: the int4-awq row takes its
    calibration section); not changed. Every row: the model source ``model_dir``, the validate split
    cut to 8 windows and 2 x 8 generated tokens, the gates replaced by "perplexity within 10x" (random
    weights: it says only that the numbers are finite), its own work, output and Triton names. An
    int4-awq row: ``quantize.weights: {method: awq, block_size: INT4_BLOCK}`` and fp8-llm's
    ``quantize.calibration``, int4-llm's build targets (sm86/89/120) and ONNX Runtime serving.

    Raises:
        ValueError: an unknown ``precision`` or ``size``, or :data:`INT4_BLOCK` not dividing the
            size's hidden or intermediate size (TensorRT refuses a partial block).
    """
    if precision not in BASES:
        raise ValueError(f"precision {precision!r}; valid: {', '.join(BASES)}")
    if size not in SIZES:
        raise ValueError(f"size {size!r}; valid: {', '.join(SIZES)}")
    data = copy.deepcopy(bases[BASES[precision]])
    tag = size.replace(".", "_") + ("" if precision == "fp8" else f"-{precision}")  # a recipe name has no dots
    data["name"] = f"scale-{tag}"
    data["model"] = {"kind": "text-generation", "source": {"path": str(model_dir)}}
    data["validate"].update(max_windows=8, generation={"prompts": 2, "new_tokens": 8})
    data["validate"]["gates"] = [{"metric": "relative_perplexity_increase", "max": 9.0}]
    data["work_dir"], data["output_dir"] = str(ws / "artifacts"), str(ws / "model_repository")
    triton_name = f"scale_{tag.replace('-', '_')}"
    data["triton"].update(model_name=triton_name, generate_model_name=f"{triton_name}_generate")
    if precision == "int4-awq":
        ks = {k: SIZES[size][k] for k in ("hidden_size", "intermediate_size")}
        bad = {k: v for k, v in ks.items() if v % INT4_BLOCK}
        if bad:
            raise ValueError(f"INT4 block {INT4_BLOCK} does not divide {size}'s {bad}")
        data["quantize"]["weights"] = {"method": "awq", "block_size": INT4_BLOCK}
        data["quantize"]["calibration"] = copy.deepcopy(bases["fp8-llm"]["quantize"]["calibration"])
    return data


def write_recipe(size: str, precision: str, model_dir: Path, ws: Path) -> Path:
    """:func:`scale_recipe` on the shipped recipes, written to ``ws``; returns its path."""
    bases = {name: yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text()) for name in set(BASES.values())}
    data = scale_recipe(bases, size, precision, model_dir, ws)
    path = ws / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Watchdog(threading.Thread):
    """Samples the RSS of ``proc`` and its children; kills the tree above ``limit`` bytes."""

    def __init__(self, proc: subprocess.Popen, limit: int):
        super().__init__(daemon=True)
        self.proc, self.limit, self.peak, self.killed = proc, limit, 0, False

    def run(self) -> None:
        root = psutil.Process(self.proc.pid)
        while self.proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in tree)
            except psutil.Error:
                rss = 0
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                self.killed = True
                for p in reversed(tree):
                    p.kill()
                return
            time.sleep(0.5)


def build(recipe: Path, ws: Path, limit: int) -> dict:
    """One build in a fresh process: rc, wall time, the watchdog's peak and the manifest's stages."""
    cmd = [sys.executable, "-m", "pipeline", "build", str(recipe), "--quiet"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    dog = Watchdog(proc, limit)
    dog.start()
    out, _ = proc.communicate()
    dog.join()
    result = {"rc": proc.returncode, "wall_s": time.perf_counter() - start, "peak_gib": dog.peak / 2**30,
              "killed_at_limit": dog.killed, "tail": out[-2000:]}
    run_dir = ws / "artifacts" / recipe.stem
    man = run_dir / "manifest.json"
    if man.is_file():
        result["stages"] = json.loads(man.read_text())["stages"]
    budget = run_dir / "quantize" / "budget.json"
    if budget.is_file():
        trials = json.loads(budget.read_text())["trials"]
        result["search"] = {"trials": len(trials), "wall_s": sum(t.get("wall_s", 0.0) for t in trials)}
    quant = run_dir / "quantize" / "stage.json"
    if quant.is_file():
        awq = json.loads(quant.read_text())["artifact"]["calibration"].get("awq")
        if awq:
            result["awq"] = {"seconds": awq.get("seconds", {}), "fold_points": len(awq["fold_points"]),
                             "scaled_points": awq["scaled_points"], "clipped_blocks": awq["clipped_blocks"],
                             "blocks": awq["blocks"], "block_output_error": awq["block_output_error"],
                             "block_output_error_rtn": awq["block_output_error_rtn"],
                             "block_output_error_clipped": awq["block_output_error_clipped"]}
    stamp = run_dir / "build" / "engine_stamp.json"
    if stamp.is_file():
        result["engine_bytes"] = json.loads(stamp.read_text()).get("engine_bytes")
    result["stage_reached"] = next((s for s in STAGES if not (run_dir / s / "stage.json").is_file()), "done")
    return result


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def print_table(rows: dict[str, dict]) -> None:
    print(f"{'model':15s} {'params':>8s} {'FP32 GiB':>8s} | " + " | ".join(f"{s:>17s}" for s in STAGES)
          + " | total s | peak GiB | engine/W | search")
    for name, r in rows.items():
        cells = []
        for s in STAGES:
            st = r.get("stages", {}).get(s)
            cells.append(f"{st['wall_s']:7.1f}s {st['peak_rss_mib'] / 1024:5.2f}G {st['peak_rss_mib'] * 2**20 / r['weights']:4.1f}x"
                         if st and st.get("peak_rss_mib") else f"{'-':>17s}")
        search, awq = r.get("search", {}), r.get("awq", {})
        engine = f"{r['engine_bytes'] / r['weights']:8.3f}" if r.get("engine_bytes") else f"{'-':>8s}"
        print(f"{name:15s} {r['params'] / 1e9:7.3f}B {r['weights'] / 2**30:8.2f} | " + " | ".join(cells)
              + f" | {r['wall_s']:7.1f} | {r['peak_gib']:8.2f} | {engine} | "
              + (f"{search['trials']} trials {search['wall_s']:.0f}s" if search else "")
              + ("awq " + ", ".join(f"{k} {v:.0f}s" for k, v in awq["seconds"].items()) if awq else "")
              + ("" if r["rc"] in (0, 1) else f"  FAILED rc={r['rc']} in {r['stage_reached']}"
                 + (" (memory limit)" if r["killed_at_limit"] else
                    " (SIGKILL not from the watchdog: the kernel's OOM killer? see dmesg)" if r["rc"] == -9 else "")))
    names = list(rows)
    for a, b in zip(names, names[1:]):
        ra, rb = rows[a], rows[b]
        if rb["rc"] not in (0, 1) or ra["precision"] != rb["precision"]:
            continue
        x = math.log(rb["params"] / ra["params"])
        print(f"{a} -> {b}: time slope {math.log(rb['wall_s'] / ra['wall_s']) / x:.2f}, "
              f"peak memory slope {math.log(rb['peak_gib'] / ra['peak_gib']) / x:.2f} (log-log; 1.0 = linear)")
    print("Random weights: the gate (perplexity within 10x) only says the numbers are finite. "
          "engine/W: engine file bytes over the FP32 weight bytes.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--precisions", default="fp8", help=f"comma-separated, of {', '.join(BASES)}")
    ap.add_argument("--limit-gib", type=float, default=21.0, help="stop a build whose RSS passes this (GiB)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    precisions = args.precisions.split(",")
    unknown = [p for p in precisions if p not in BASES] + [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        ap.error(f"unknown {', '.join(unknown)}: sizes are {', '.join(SIZES)}, precisions {', '.join(BASES)}")
    from pipeline.memory import release_freed

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        for precision in precisions:  # one precision's sizes side by side: its slopes compare neighbours
            for size in args.sizes.split(","):
                ws = Path(tmp) / f"{size}-{precision}"
                model_dir, params = make_model(size, ws / "model")
                release_freed()  # the random model's pages, before the build's process needs the memory
                recipe = write_recipe(size, precision, model_dir, ws)
                name = f"{size} {precision}"
                rows[name] = {"size": size, "precision": precision, "params": params,
                              "weights": weight_bytes(model_dir), **build(recipe, ws, int(args.limit_gib * 2**30))}
                r = rows[name]
                print(f"{name}: rc {r['rc']}, {r['wall_s']:.0f} s, peak {r['peak_gib']:.2f} GiB", flush=True)
                if args.json:  # after each build: a later one that is stopped keeps the earlier rows
                    args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
