"""The pipeline's cost against model size (issue 24 §2): random-weight Llama-family models
of about 135 M, 0.5 B and 1.1 B parameters, each built by fp8-llm's recipe (export,
calibration and the accuracy-budget search, the TensorRT-RTX build, validate, triton).

Shapes: SmolLM2-135M's (576 hidden, 30 layers, GQA 9/3, tied embeddings), a 0.5 B
Llama (1536 hidden, 16 layers, GQA 12/4, tied) and TinyLlama-1.1B's (2048 hidden,
22 layers, GQA 32/4, untied), all with the SmolLM2 tokenizer (49152 tokens), so
the 1.1 B one has 1.17 B parameters. Weights are random (seed 0): accuracy means
nothing here, so the recipe's gate is loosened to "perplexity within 10x" and
only says the numbers are finite; the validate split is cut to 8 windows.

Each build is a fresh ``python -m pipeline build`` process; a watchdog samples the
resident set of its process tree every 0.5 s and stops it above ``--limit-gib``
(default 21: this machine has 24), reporting the stage it was in. Prints per model
and stage the wall time (s) and peak RSS (GiB, from the manifest) against the FP32
weight bytes, the search's trial count and time, then the cost curve: each total
against parameters, with the log-log slope between neighbours (1.0 = linear).

    .venv/bin/python benchmarks/scale.py [--sizes 135m,0.5b,1.1b] [--limit-gib 21] [--json out.json]
"""
from __future__ import annotations

import argparse
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


def write_recipe(size: str, model_dir: Path, ws: Path) -> Path:
    """fp8-llm's recipe on ``model_dir``, with a loose gate and a shorter validate split."""
    data = yaml.safe_load((ROOT / "recipes" / "fp8-llm.yaml").read_text())
    data["name"] = f"scale-{size.replace('.', '_')}"  # a recipe name has no dots
    data["model"] = {"kind": "text-generation", "source": {"path": str(model_dir)}}
    data["validate"].update(max_windows=8, generation={"prompts": 2, "new_tokens": 8})
    data["validate"]["gates"] = [{"metric": "relative_perplexity_increase", "max": 9.0}]
    data["work_dir"], data["output_dir"] = str(ws / "artifacts"), str(ws / "model_repository")
    data["triton"].update(model_name=f"scale_{size.replace('.', '_')}",
                          generate_model_name=f"scale_{size.replace('.', '_')}_generate")
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
    result["stage_reached"] = next((s for s in STAGES if not (run_dir / s / "stage.json").is_file()), "done")
    return result


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def print_table(rows: dict[str, dict]) -> None:
    print(f"{'model':6s} {'params':>8s} {'FP32 GiB':>8s} | " + " | ".join(f"{s:>17s}" for s in STAGES)
          + " | total s | peak GiB | search")
    for size, r in rows.items():
        cells = []
        for s in STAGES:
            st = r.get("stages", {}).get(s)
            cells.append(f"{st['wall_s']:7.1f}s {st['peak_rss_mib'] / 1024:5.2f}G {st['peak_rss_mib'] * 2**20 / r['weights']:4.1f}x"
                         if st and st.get("peak_rss_mib") else f"{'-':>17s}")
        search = r.get("search", {})
        print(f"{size:6s} {r['params'] / 1e9:7.3f}B {r['weights'] / 2**30:8.2f} | " + " | ".join(cells)
              + f" | {r['wall_s']:7.1f} | {r['peak_gib']:8.2f} | "
              + (f"{search['trials']} trials {search['wall_s']:.0f}s" if search else "-")
              + ("" if r["rc"] in (0, 1) else f"  FAILED rc={r['rc']} in {r['stage_reached']}"
                 + (" (memory limit)" if r["killed_at_limit"] else "")))
    sizes = list(rows)
    for a, b in zip(sizes, sizes[1:]):
        ra, rb = rows[a], rows[b]
        if rb["rc"] not in (0, 1):
            continue
        x = math.log(rb["params"] / ra["params"])
        print(f"{a} -> {b}: time slope {math.log(rb['wall_s'] / ra['wall_s']) / x:.2f}, "
              f"peak memory slope {math.log(rb['peak_gib'] / ra['peak_gib']) / x:.2f} (log-log; 1.0 = linear)")
    print("Random weights: the gate (perplexity within 10x) only says the numbers are finite.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--limit-gib", type=float, default=21.0, help="stop a build whose RSS passes this (GiB)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    from pipeline.memory import release_freed

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        for size in args.sizes.split(","):
            ws = Path(tmp) / size
            model_dir, params = make_model(size, ws / "model")
            release_freed()  # the random model's pages, before the build's process needs the memory
            recipe = write_recipe(size, model_dir, ws)
            rows[size] = {"params": params, "weights": weight_bytes(model_dir),
                          **build(recipe, ws, int(args.limit_gib * 2**30))}
            print(f"{size}: rc {rows[size]['rc']}, {rows[size]['wall_s']:.0f} s, peak {rows[size]['peak_gib']:.2f} GiB",
                  flush=True)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
