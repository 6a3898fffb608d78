"""The capacity plan's outputs: ``plan.md`` (per-GPU table, this machine's measured check, the
formulas and their sources), ``plan.png`` and ``plan.json`` (strict JSON)."""
from __future__ import annotations

from pathlib import Path

from pipeline.recipe.precisions import facts


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def render_markdown(plan: dict) -> str:
    """plan.md: the per-GPU table, this machine's measured check, the formulas and their sources."""
    m, req = plan["model"], plan["request"]
    lines = [
        f"# Capacity plan: {plan['recipe']}", "",
        f"{plan['label']}.", "",
        f"Model: {m['parameters']:,} parameters ({m['quantized_parameters']:,} in {m['precision']} GEMMs), "
        f"{m['layers']} layers x {m['kv_heads']} KV heads x head_dim {m['head_dim']}, KV {m['kv_dtype']}; "
        f"max batch {m['max_batch']}, max context {m['max_context']} tokens, workspace {_mb(m['workspace_bytes'])} MB.",
        f"Request: {req['prompt_tokens']} prompt + {req['output_tokens']} output tokens at {req['rate_per_s']:g} req/s "
        f"({req['rate_source']}); SLO TTFT <= {req['slo']['ttft_ms']:g} ms, TPOT <= {req['slo']['tpot_ms']:g} ms.", "",
        "| GPU | memory GB | bandwidth GB/s | weights MB | KV/token KB | KV at limit MB | max concurrent seqs "
        "| decode roofline tok/s/seq @max ctx | prefill FLOP/B vs ridge | replicas (estimate) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in plan["gpus"]:
        g, p, rep = r["gpu"], r["prefill"], r["replicas"]
        replicas = (f"{rep['replicas']} ({rep['requests_per_s_per_replica']:,.0f} req/s each at batch {rep['batch']})"
                    if rep["replicas"] is not None else f"n/a: {rep['reason']}")
        lines.append(
            f"| {g['name']} | {g['memory_gb']:g} | {g['bandwidth_gbs']:,g} | {_mb(r['weights_bytes'])} "
            f"| {r['kv_bytes_per_token'] / 1e3:,.2f} | {_mb(r['kv_bytes_at_limit'])} | {r['max_concurrent_sequences']:,} "
            f"| {r['decode_roofline_tokens_per_s_at_max_context']:,.0f} "
            f"| {p['intensity_flop_per_byte']:,.0f} vs {p['ridge_flop_per_byte']:,.0f} ({p['peak']}): {p['bound']} bound "
            f"| {replicas} |")
    lines += ["", f"max concurrent seqs: what memory holds at max context; one engine batch is capped at "
                  f"max batch {m['max_batch']} (build profile 0 / triton.max_batch_size).",
              "", "Sources: " + "; ".join(f"{r['gpu']['name']}: {r['gpu']['source']} <{r['gpu']['url']}>"
                                            for r in plan["gpus"]) + "."]
    notes = [f"{r['gpu']['name']}: {n}" for r in plan["gpus"] for n in r["notes"]]
    lines += [f"- {n}" for n in notes]
    lines += ["", *render_machine(plan["this_machine"], m), "", "## Formulas", ""]
    lines += [f"- **{k}**: {v['expression']}. Source: {v['source']}." for k, v in plan["formulas"].items()]
    return "\n".join(lines) + "\n"


def render_machine(t: dict, m: dict) -> list[str]:
    """This machine's measured lines: bandwidth, KV bytes check, decode tokens/s vs roofline (MBU)."""
    bw, kv = t["bandwidth"], t["kv_check"]
    lines = [
        "## This machine (CPU, measured)", "",
        f"- Copy bandwidth: {bw['median_gbs']:.2f} GB/s (median of {bw['repeats']} runs, {bw['size_mib']} MiB, "
        f"{bw['method']}).",
        f"- Served weights ({m['precision'].upper() if facts(m['precision']).cast else 'FP32 after load-time dequantization'}): "
        f"{_mb(t['weights_bytes'])} MB; decode roofline at "
        f"max context {t['decode_roofline_tokens_per_s_at_max_context']:.1f} tok/s per sequence.",
        f"- KV check: present.* of one ONNX Runtime run at batch {kv['batch']}, {kv['tokens']} tokens = "
        f"{kv['bytes']:,} bytes; formula {kv['formula_bytes']:,} bytes ({'match' if kv['match'] else 'MISMATCH'}).",
    ]
    for c in t["measured"]:
        lines.append(f"- Decode ({c['what']}, context ~{c['context']:.0f}): {c['tokens_per_s']:.2f} tok/s measured vs "
                     f"{c['roofline_tokens_per_s']:.2f} roofline ({_mb(c['bytes_per_step'])} MB per step): "
                     f"MBU {100 * c['mbu']:.0f} %.")
    if not t["measured"]:
        lines.append("- Decode: no measurement (no bench/bench.json; run `pipeline bench` or pass --measure).")
    return lines


def plot(plan: dict, path: Path) -> None:
    """PNG: decode roofline tokens/s per sequence and max concurrent sequences, per GPU (log scales)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["gpu"]["name"] for r in plan["gpus"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, [r["decode_roofline_tokens_per_s_at_max_context"] for r in plan["gpus"]], color="tab:blue")
    machine = plan["this_machine"]
    ax1.bar(["this CPU\n(measured GB/s)"], [machine["decode_roofline_tokens_per_s_at_max_context"]], color="tab:gray")
    for case in machine["measured"]:
        ax1.plot(["this CPU\n(measured GB/s)"], [case["tokens_per_s"]], "o", color="tab:red",
                 label=f"measured {case['tokens_per_s']:.1f} tok/s (ctx {case['context']:.0f})")
    if machine["measured"]:
        ax1.legend(fontsize=8)
    ax1.set_yscale("log")
    ax1.set_title(f"decode roofline, tokens/s per sequence\n(batch 1, context {plan['model']['max_context']})")
    ax2.bar(names, [max(r["max_concurrent_sequences"], 1) for r in plan["gpus"]], color="tab:orange")
    ax2.set_yscale("log")
    ax2.set_title("max concurrent sequences at max context\n(memory - weights - workspace) / KV per sequence")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{plan['recipe']}: estimates from published peak figures")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plan(plan: dict, out_dir: Path) -> dict[str, Path]:
    """Write plan.json (strict JSON), plan.md and plan.png into ``out_dir``; returns their paths."""
    from pipeline.fsutil import write_json_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "plan.json", "md": out_dir / "plan.md", "png": out_dir / "plan.png"}
    write_json_atomic(paths["json"], plan)
    paths["md"].write_text(render_markdown(plan))
    plot(plan, paths["png"])
    return paths
