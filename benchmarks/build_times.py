"""Cold build, then warm no-change rebuild, of one recipe, side by side; each
stage's peak memory against the model's FP32 weight bytes; then the quantize
stage's memory on a Llama over 2 GiB.

Prints each stage's wall time (s) and peak RSS (MiB) from the cold run's
manifest, the whole-process wall time and peak RSS of both runs, and their
ratio. Each run is a fresh `python -m pipeline build` process with its own
empty work and output folders, so nothing is shared with earlier builds.

The memory table runs export, quantize with calibration (the pin ignored, as
`tune` does: calibration, SmoothQuant statistics and the accuracy-budget
search), and validate each in a fresh process of its own (the earlier stages
come from the stage cache), so no stage inherits another's heap. Each stage's
peak RSS is set against the FP32 weight bytes (the exported graph's files) and
the aim of issue 24: peak RSS <= 3 x weight bytes + 0.5 GiB.

Then (unless ``--skip-large``) a random-weight Llama a little over 2 GiB in
FP32 (one layer, tied 49152 x 11008 embedding, built with transformers into a
temp folder) goes through the same recipe shrunk to mechanics-test sizes: it
takes the external-data path in every stage. For both models the quantize
stage's peak RSS is printed next to the FP32 model size (target: <= 3x).

    .venv/bin/python benchmarks/build_times.py --recipe recipes/fp8-llm.yaml [--before REV]

``--before REV`` measures the memory table a second time with the code and recipe of git revision
REV (checked out in a temporary worktree; the same venv) and prints both side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(recipe: str, ws: Path) -> tuple[float, int, dict]:
    cmd = [sys.executable, "-m", "pipeline", "build", recipe, "--quiet",
           "--set", f"work_dir={ws / 'artifacts'}", "--set", f"output_dir={ws / 'model_repository'}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode not in (0, 1):
        sys.exit(f"build failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    name = Path(recipe).stem
    man = json.loads((ws / "artifacts" / name / "manifest.json").read_text())
    # ru_maxrss of children is the max over all children so far: report it only when it grew.
    return wall, max(peak_kib, before) // 1024 if peak_kib > before else -1, man


#: one fresh process per stage: (label, Python run in it with ``recipe`` loaded)
_STAGE_DRIVERS = [
    ("export", "run_pipeline(recipe, path, quiet=True, only=['export'])"),
    ("quantize (calibrated)", "run_tune(recipe, path, quiet=True)"),
    ("quantize (pinned)", "run_pipeline(recipe, path, quiet=True, only=['quantize'])"),
    ("validate", "run_pipeline(recipe, path, quiet=True, only=['validate'])"),
]


def _stage_process(recipe: str, ws: Path, call: str, code_dir: Path) -> None:
    """``call`` in a fresh ``python -c`` run in ``code_dir``, whose ``pipeline`` package it imports."""
    code = ("import sys; from pathlib import Path; from pipeline.recipe.load import load_recipe; "
            "from pipeline.run.runner import run_pipeline, run_tune; path = Path(sys.argv[1]); "
            "recipe = load_recipe(path, {'work_dir': sys.argv[2], 'output_dir': sys.argv[3]}); " + call)
    proc = subprocess.run([sys.executable, "-c", code, recipe, str(ws / "artifacts"), str(ws / "model_repository")],
                          capture_output=True, text=True, cwd=code_dir)
    if proc.returncode != 0:
        sys.exit(f"{call} failed ({proc.returncode}) in {code_dir}:\n{proc.stderr[-3000:]}")


def stage_memory(recipe: str, ws: Path, only: list[str] | None = None,
                 code_dir: Path = Path.cwd()) -> list[tuple[str, float, float]]:
    """(stage, peak RSS MiB, wall s) of export, quantize calibrated (the pin ignored) and
    pinned, and validate (of the pinned model), each in a fresh process (earlier stages
    from the stage cache), with the ``pipeline`` package and ``recipe`` of ``code_dir``."""
    rows = []
    recipe = str((code_dir / recipe).resolve())
    run_dir = ws / "artifacts" / Path(recipe).stem
    for label, call in _STAGE_DRIVERS:
        if only and label not in only:
            continue
        _stage_process(recipe, ws, call, code_dir)
        rec = json.loads((run_dir / label.split()[0] / "stage.json").read_text())["record"]
        rows.append((label, float(rec.get("peak_rss_mib") or 0), float(rec["wall_s"])))
    return rows


def memory_table(name: str, rows: list[tuple[str, float, float]], weight_bytes: int) -> str:
    """Each stage's peak RSS over the FP32 weight bytes, against 3 x weights + 0.5 GiB."""
    aim = 3 * weight_bytes + 0.5 * 2**30
    lines = [f"{name}: FP32 weights {weight_bytes / 2**30:.2f} GiB; aim: peak RSS <= 3 x weights + 0.5 GiB "
             f"= {aim / 2**30:.2f} GiB",
             f"{'stage':<22} {'wall (s)':>9} {'peak RSS (GiB)':>15} {'RSS / weights':>14} {'aim':>7}"]
    for label, mib, wall in rows:
        rss = mib * 2**20
        lines.append(f"{label:<22} {wall:>9.1f} {rss / 2**30:>15.2f} {rss / weight_bytes:>13.1f}x "
                     f"{'met' if rss <= aim else 'MISSED':>7}")
    return "\n".join(lines)


def compare_table(name: str, before: list, after: list, weight_bytes: int, rev: str) -> str:
    """Each stage's peak RSS (GiB and x the FP32 weight bytes) at ``rev`` and now, side by side."""
    was = {label: mib for label, mib, _ in before}
    gib = 2**30
    lines = [f"{name}: peak RSS per stage at {rev} (before) and in this checkout (after), same machine, one run; "
             f"FP32 weights W = {weight_bytes / gib:.2f} GiB",
             f"{'stage':<22} {'before GiB':>11} {'x W':>6} {'after GiB':>10} {'x W':>6} {'after/before':>13}"]
    for label, mib, _ in after:
        b, a = was.get(label, 0.0) * 2**20, mib * 2**20
        ratio = f"{a / b:.2f}" if b else "n/a"
        lines.append(f"{label:<22} {b / gib:>11.2f} {b / weight_bytes:>5.1f}x {a / gib:>10.2f} "
                     f"{a / weight_bytes:>5.1f}x {ratio:>13}")
    return "\n".join(lines)


def before_rows(rev: str, recipe: str, only: list[str] | None) -> list:
    """The memory table's rows with the code and recipe of git revision ``rev`` (a worktree; files
    git ignores, such as rendered data under ``artifacts/``, are not in it)."""
    try:
        rel = Path(recipe).resolve().relative_to(ROOT)  # the same recipe file, as it was at ``rev``
    except ValueError:
        sys.exit(f"--before: the recipe {recipe} is not inside this repository ({ROOT}), so it has no revision {rev}")
    with tempfile.TemporaryDirectory(prefix="trtpipe-bench-before-") as tmp:
        tree = Path(tmp) / "tree"
        git = subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], capture_output=True, text=True,
                             cwd=ROOT)
        if git.returncode != 0:
            sys.exit(f"--before {rev}: git worktree add failed: {git.stderr.strip()}")
        try:
            return stage_memory(str(rel), Path(tmp) / "ws", only, code_dir=tree)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], capture_output=True, cwd=ROOT)


def make_large_llama(folder: Path) -> int:
    """Random one-layer Llama with a tied 49152 x 11008 embedding (~2.2 GB FP32),
    saved with the SmolLM2 tokenizer. Returns its FP32 parameter bytes."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline.sources.model import package_file
    from pipeline.recipe.load import load_recipe

    src = package_file(load_recipe(Path("recipes/fp8-llm.yaml")).model)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=11008, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return nbytes


def large_recipe(ws: Path, model_dir: Path) -> Path:
    """recipes/fp8-llm.yaml with the large model and mechanics-test sizes."""
    import yaml

    data = yaml.safe_load(Path("recipes/fp8-llm.yaml").read_text())
    data["name"] = "large-llm"
    data["model"] = {"kind": "text-generation", "package": None, "path": str(model_dir)}
    data["export"]["check_points"] = [{"batch": 1, "sequence": 4, "past_sequence": 0},
                                      {"batch": 3, "sequence": 1, "past_sequence": 5},
                                      {"batch": 2, "sequence": 7, "past_sequence": 9}]
    data["export"]["tolerances"] = {"logits": {"rtol": 0.05, "atol": 0.5}, "present.*": {"rtol": 0.01, "atol": 0.01}}
    data["quantize"]["calibration"].update(samples=8, seq_len=32, batch_size=4)
    data["quantize"]["exclude"] = {"nodes": []}
    data["validate"].update(seq_len=64, max_windows=4, generation={"prompts": 2, "new_tokens": 4})
    data["validate"]["gates"] = [{"metric": "relative_perplexity_increase", "max": 10.0}]
    path = ws / "large-llm.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def fp32_bytes(man: dict) -> int:
    """Bytes of the exported FP32 graph and its data files."""
    return files_bytes(man["artifacts"]["export"]["onnx_path"])


def files_bytes(onnx_path: str | Path) -> int:
    from pipeline.onnx_io import files_on_disk_bytes

    return files_on_disk_bytes(onnx_path)


def quantize_line(label: str, man: dict, fp32: int) -> str:
    rss = man["stages"]["quantize"].get("peak_rss_mib") or 0
    ratio = rss * 2**20 / fp32
    return (f"{label:<10} FP32 model {fp32 / 2**30:5.2f} GiB, quantize peak RSS {rss / 1024:5.2f} GiB = "
            f"{ratio:.1f}x the model (target <= 3x: {'met' if ratio <= 3 else 'MISSED'})")


def large_model_run() -> tuple[dict, int]:
    """Build the > 2 GiB model once; returns its manifest and FP32 parameter bytes."""
    with tempfile.TemporaryDirectory(prefix="trtpipe-bench-large-") as tmp:
        ws = Path(tmp)
        nbytes = make_large_llama(ws / "model")
        _, _, man = build(str(large_recipe(ws, ws / "model")), ws)
        man["fp32_bytes"] = fp32_bytes(man)
    return man, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/fp8-llm.yaml")
    ap.add_argument("--skip-large", action="store_true", help="do not build the > 2 GiB model (~5 GB of disk)")
    ap.add_argument("--only-large", action="store_true", help="build only the > 2 GiB model")
    ap.add_argument("--only-memory", action="store_true",
                    help="only the per-stage memory table (no cold/warm build, no large model)")
    ap.add_argument("--memory-workspace", type=Path,
                    help="keep the memory table's work folder here (a second run reuses its cached stages)")
    ap.add_argument("--memory-stages", type=lambda v: v.split(","),
                    help="comma-separated rows of the memory table to run (default: all): "
                         + ", ".join(label for label, _ in _STAGE_DRIVERS))
    ap.add_argument("--before", metavar="REV",
                    help="also measure the memory table with git revision REV's code and recipe (a worktree) and "
                         "print both side by side")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="trtpipe-bench-mem-") as tmp:
        ws = args.memory_workspace or Path(tmp)
        rows = stage_memory(args.recipe, ws, args.memory_stages)
        weights = files_bytes(ws / "artifacts" / Path(args.recipe).stem / "export" / "model.onnx")
    print(memory_table(Path(args.recipe).stem, rows, weights) + "\n")
    if args.before:
        old = before_rows(args.before, args.recipe, args.memory_stages)
        print(compare_table(Path(args.recipe).stem, old, rows, weights, args.before) + "\n")
    if args.only_memory:
        return
    if args.only_large:
        large, _ = large_model_run()
        print(quantize_line("large-llm", large, large["fp32_bytes"]))
        return
    with tempfile.TemporaryDirectory(prefix="trtpipe-bench-") as tmp:
        ws = Path(tmp)
        cold_wall, cold_rss, man = build(args.recipe, ws)
        fp32 = fp32_bytes(man)
        warm_wall, warm_rss, warm = build(args.recipe, ws)
    print(f"{'stage':<10} {'status':<8} {'wall (s)':>9} {'peak RSS (MiB)':>15}")
    for name, st in man["stages"].items():
        print(f"{name:<10} {st['status']:<8} {st['wall_s']:>9.1f} {str(st.get('peak_rss_mib')):>15}")
    hits = sum(bool(s.get("cache_hit")) for s in warm["stages"].values())
    print(f"\ncold build: {cold_wall:7.1f} s wall, peak RSS {cold_rss} MiB (whole process)")
    print(f"warm build: {warm_wall:7.1f} s wall, {hits}/{len(warm['stages'])} stages from cache")
    print(f"cold / warm wall ratio: {cold_wall / warm_wall:.1f}x")
    print(f"targets: cold < 480 s -> {'met' if cold_wall < 480 else 'MISSED'}; "
          f"peak RSS < 6144 MiB -> {'met' if 0 < cold_rss < 6144 else 'MISSED'}; "
          f"warm < 5 s -> {'met' if warm_wall < 5 else 'MISSED'}")
    print("\nquantize stage memory (peak RSS of the build process during the stage):")
    print(quantize_line(Path(args.recipe).stem, man, fp32))
    if not args.skip_large:
        large, _ = large_model_run()
        print(quantize_line("large-llm", large, large["fp32_bytes"]))


if __name__ == "__main__":
    main()
