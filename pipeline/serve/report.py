"""Markdown tables of a bench result (the dict :func:`pipeline.serve.run.bench` writes as JSON)."""
from __future__ import annotations

import math
from pathlib import Path

#: The latency-vs-throughput plot, next to bench.md.
PLOT_FILE = "latency_throughput.png"


def _n(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _pcts(p: dict) -> str:
    return " | ".join(_n(p[k]) for k in ("p50", "p90", "p99"))


def _batches(b: dict) -> str:
    sizes = ", ".join(f"{size}: {count}" for size, count in b["executions_by_batch_size"].items())
    return sizes or "none"


def render(result: dict) -> str:
    """The bench result as markdown: header, the model kind's sweep, then the batching comparison."""
    env, served = result["environment"], result["served"]
    lines = [
        f"## bench {result['recipe']}: tritonserver {env['tritonserver']}, target {served['target']}",
        "",
        f"{env['cpus']} CPUs, 1-min load average {_n(env['loadavg_1m'], 2)} at start "
        f"(shared CPU: numbers move with other load). {served['note']}.",
        "",
    ]
    if "llm" in result:
        lines += llm_tables(result["llm"], result["serve"])
    if "encoder" in result:
        lines += encoder_tables(result["encoder"], result["serve"])
    lines += batching_tables(result.get("batching"))
    if gate := result.get("slo_gate"):
        lines += ["", f"SLO gate (serve.slo.gate, min_met {_n(100 * gate['min_met'], 0)} % at every level of "
                      f"{gate['levels']}): {'passed' if gate['passed'] else 'FAILED'}",
                  *(f"- {f}" for f in gate["failures"])]
    return "\n".join(lines) + "\n"


def _requests(pos: dict) -> str:
    n = len(pos.get("requests", [])) or 1
    return "one request" if n == 1 else f"{n} requests"


def _ratio_range(pos: dict) -> str:
    low, high = pos.get("ratio_range") or (None, None)
    return "" if low is None or len(pos.get("requests", [])) < 2 else f"; single requests {_n(low, 2)} to {_n(high, 2)}"


def llm_tables(llm: dict, serve: dict) -> list[str]:
    slo, pos = serve["slo"], llm["tpot_by_position"]
    first, second = serve["tpot_positions"]
    out = [
        f"### Streaming generation: {serve['max_tokens']} output tokens per request (EOS ignored), "
        f"{llm['prompt_tokens']}-token prompts, {serve['requests_per_level']} requests per level",
        "",
        f"Goodput: requests/s with TTFT <= {_n(slo['ttft_ms'], 0)} ms and TPOT <= {_n(slo['tpot_ms'], 0)} ms "
        "(recipe serve.slo). Times in ms.",
        "",
        "| concurrency | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p90 | TPOT p99 | ITL p99 "
        "| output tok/s | req/s | goodput req/s | SLO met |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in llm["levels"]:
        out.append(f"| {lv['concurrency']} | {_pcts(lv['ttft_ms'])} | {_pcts(lv['tpot_ms'])} | {_n(lv['itl_ms']['p99'])} "
                   f"| {_n(lv['output_tokens_per_s'])} | {_n(lv['requests_per_s'], 2)} | {_n(lv['goodput_rps'], 2)} "
                   f"| {_n(100 * lv['slo_met'], 0)}% |")
    if llm.get("levels_static"):
        out += ["", f"Continuous batching off ({llm.get('static_model', '')}: each request decodes alone):", "",
                "| concurrency | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p90 | TPOT p99 | ITL p99 "
                "| output tok/s | req/s | goodput req/s | SLO met |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for lv in llm["levels_static"]:
            out.append(f"| {lv['concurrency']} | {_pcts(lv['ttft_ms'])} | {_pcts(lv['tpot_ms'])} "
                       f"| {_n(lv['itl_ms']['p99'])} | {_n(lv['output_tokens_per_s'])} | {_n(lv['requests_per_s'], 2)} "
                       f"| {_n(lv['goodput_rps'], 2)} | {_n(100 * lv['slo_met'], 0)}% |")
        speedup = "; ".join(f"{c}: **{_n(r, 2)}x**" for c, r in llm.get("batching_speedup", {}).items())
        out += ["", f"Output tokens/s, continuous batching on over off, by concurrency: {speedup}"]
    elif llm.get("levels_static_skipped"):
        out += ["", f"Continuous batching off: not measured ({llm['levels_static_skipped']})."]
    levels = llm["levels"]
    if len(levels) > 1 and levels[0]["output_tokens_per_s"]:
        top = max(levels, key=lambda lv: lv["concurrency"])
        out += ["", f"Output tokens/s at concurrency {top['concurrency']} over concurrency {levels[0]['concurrency']}: "
                    f"**{_n(top['output_tokens_per_s'] / levels[0]['output_tokens_per_s'], 2)}x**"]
    sched = [lv for lv in levels if lv.get("scheduler_batches")]
    if sched:
        out += ["", "Scheduler steps by batch size (the generation model's own statistics):", "",
                "| concurrency | steps by batch size | mean batch |", "|---:|---|---:|"]
        out += [f"| {lv['concurrency']} | {_batches(lv['scheduler_batches'])} "
                f"| {_n(lv['scheduler_batches']['mean_batch'], 2)} |" for lv in sched]
    if llm.get("plot"):
        out += ["", f"![latency vs throughput]({llm['plot']})"]
    out += agreement_table(llm.get("client_agreement"))
    out += aiperf_table(llm.get("aiperf"), levels)
    out += [
        "",
        f"TPOT by output position ({_requests(pos)} of {pos['tokens']} tokens, concurrency 1, one after another; "
        f"per request the median gap of 8 positions, then the median over requests): "
        f"~{first}: {_n(pos['tpot_ms'][str(first)])} ms, ~{second}: {_n(pos['tpot_ms'][str(second)])} ms, "
        f"ratio {second}/{first} = **{_n(pos['ratio'], 2)}**{_ratio_range(pos)} (KV cache: near 1; recomputing "
        "the prefix would grow with position).",
        *_overhead_line(llm.get("serving_overhead")),
    ]
    if not any(lv["compute_batches"].get("executions") for lv in llm["levels"]):
        return out + ["", "The compute model's Triton statistics count no executions during the sweep: the "
                          "generation model runs the graph in its own process (python-onnxruntime), so its "
                          "scheduler steps above are the batches.", ""]
    out += [
        "",
        "Compute-model executions by batch size during the sweep (Triton statistics; with the generation model's "
        "scheduler, each is one step of the batched sequences, past padded on the left):",
        "",
        "| concurrency | executions by batch size | mean batch |",
        "|---:|---|---:|",
    ]
    out += [f"| {lv['concurrency']} | {_batches(lv['compute_batches'])} | {_n(lv['compute_batches']['mean_batch'], 2)} |"
            for lv in llm["levels"]]
    return out + [""]


def _overhead_line(overhead: dict | None) -> list[str]:
    """The served batch-1 TPOT against the graph's own decode step (bench.serving_overhead)."""
    if not overhead:
        return []
    if "skipped" in overhead:
        return ["", f"Served TPOT vs the graph's own decode step: not measured ({overhead['skipped']})."]
    lo, hi = overhead["contexts"]
    return ["", f"Served batch-1 TPOT {_n(overhead['served_tpot_ms'])} ms (median of a request before and after) vs "
                f"the served graph's own decode step {_n(overhead['graph_step_ms'])} ms (ONNX Runtime alone, batch 1, "
                f"contexts {lo}-{hi}, same run): ratio **{_n(overhead['ratio'], 2)}**."]


def encoder_tables(enc: dict, serve: dict) -> list[str]:
    out = [
        f"### {enc['model']}: one sentence per request ({enc['sentences']} held-out sentences), "
        f"{serve['requests_per_level']} requests per level",
        "",
        f"Goodput: requests/s with latency <= {_n(serve['slo']['latency_ms'], 0)} ms. Times in ms. The tokenizer "
        "model pads each request to a multiple of 16 tokens, so requests of similar length share a shape and can "
        "share a compute batch.",
        "",
        "| concurrency | latency p50 | latency p90 | latency p99 | inferences/s | goodput req/s "
        "| compute executions by batch size |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    out += [f"| {lv['concurrency']} | {_pcts(lv['latency_ms'])} | {_n(lv['inferences_per_s'])} "
            f"| {_n(lv['goodput_rps'], 2)} | {_batches(lv['compute_batches'])} |" for lv in enc["levels"]]
    return out + [""]


def batching_tables(batching: dict | None) -> list[str]:
    if not batching or not batching.get("variants"):
        reason = (batching or {}).get("skipped", "not run")
        return ["### Dynamic batching and instances", "", f"Not measured: {reason}.", ""]
    shapes = ", ".join(f"{n} {s}" for n, s in batching["bucket_shapes"].items())
    out = [
        "### Dynamic batching and instances: same compute model, one server, one run",
        "",
        f"Shapes bucketed to one length: every request is {shapes}"
        f"{' with an empty past (a prefill)' if batching.get('empty_past') else ''}, so any requests can "
        f"share a batch; {batching['requests']} requests per variant at concurrency {batching['concurrency']}, "
        f"max_batch_size {batching['max_batch_size']}. Executions by batch size from Triton's statistics extension; "
        "busy instances = summed execution time / wall time.",
        "",
        "| variant | dynamic batching | instances | inferences/s | latency p50 | p90 | p99 (ms) "
        "| executions by batch size | mean batch | busy instances |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in batching["variants"]:
        b = r["batches"]
        out.append(f"| {r['variant']} | {'on' if r['dynamic_batching'] else 'off'} | {r['instances']} "
                   f"| {_n(r['inferences_per_s'], 2)} | {_pcts(r['latency_ms'])} | {_batches(b)} "
                   f"| {_n(b['mean_batch'], 2)} | {_n(b['busy_instances'], 2)} |")
    ratios = batching["ratios"]
    out += ["", "Throughput ratios: " + "; ".join(f"{k.replace('_', ' ')} = **{_n(v, 2)}x**" for k, v in ratios.items()), ""]
    return out


def agreement_table(agree: dict | None) -> list[str]:
    """Served (OpenAI endpoint, temperature 0) vs validate greedy tokens by concurrency, and the echo perplexity."""
    if not agree:
        return []
    if "skipped" in agree:
        return ["", f"Served vs validated greedy tokens: not compared ({agree['skipped']})."]
    out = ["", f"Served vs validated: the validate prompts through the OpenAI endpoint ({agree['client']} client, "
               f"temperature 0) against the validate stage's {agree['precision']} greedy tokens. Concurrency 1 must "
               "be equal; batched, a prompt may differ from the batch-1 reference's first near tie on (top-2 logit "
               f"gap < {agree['tie_tolerance']}). Agreement: validate tokens matched at their position.", "",
           "| concurrency | prompts | token agreement | equal | differ after a near tie | mismatches |",
           "|---:|---:|---:|---:|---|---|"]
    for lv in agree["levels"]:
        bad = "; ".join(f"prompt {m['prompt']}" for m in lv["mismatches"]) or "none"
        ties = ", ".join(str(i) for i in lv["tie_excused"]) or "none"
        out.append(f"| {lv['concurrency']} | {lv['prompts']} | {_n(100 * lv['agreement'], 1)}% | {lv['equal']} "
                   f"| {ties} | {bad} |")
    ppl = agree.get("perplexity") or {}
    if "skipped" in ppl:
        out += ["", f"Perplexity from echo logprobs: not measured ({ppl['skipped']})."]
    elif ppl:
        out += ["", f"Perplexity of the {ppl['windows']} validate windows from the endpoint's echo logprobs: "
                    f"{_n(ppl['perplexity'], 3)} vs validate's {_n(ppl['validate'], 3)} (relative difference "
                    f"{_n(100 * (ppl['relative_difference'] or 0), 3)}%)."]
    return out


def aiperf_table(aiperf: dict | None, levels: list[dict]) -> list[str]:
    """AIPerf's TTFT and ITL (p50 / p99) next to ours, by concurrency."""
    if not aiperf:
        return []
    if not aiperf.get("levels"):
        if aiperf.get("failed"):
            return ["", f"AIPerf failed: {aiperf['failed']}"]
        return ["", f"AIPerf: not run ({aiperf.get('skipped', 'no result')})."]
    ours = {lv["concurrency"]: lv for lv in levels}
    out = ["", "AIPerf (streaming /v1/completions through the OpenAI endpoint, same prompt and output lengths) "
               "next to ours (gRPC straight to Triton). Times in ms. AIPerf runs on the same CPUs as the server: "
               "its figures include its own client cost, so its CPU use (its processes' user + system CPU time "
               "over the run's wall time, in cores) is given next to them.", "",
           "| concurrency | TTFT p50 ours | TTFT p50 AIPerf | TTFT p99 ours | TTFT p99 AIPerf | ITL p50 ours "
           "| ITL p50 AIPerf | ITL p99 ours | ITL p99 AIPerf | AIPerf CPU (cores) |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a in aiperf["levels"]:
        o = ours.get(a["concurrency"], {})
        t, i, cpu = a.get("time_to_first_token", {}), a.get("inter_token_latency", {}), a.get("client_cpu", {})
        out.append(f"| {a['concurrency']} | {_n(o.get('ttft_ms', {}).get('p50'))} | {_n(t.get('p50'))} "
                   f"| {_n(o.get('ttft_ms', {}).get('p99'))} | {_n(t.get('p99'))} | {_n(o.get('itl_ms', {}).get('p50'))} "
                   f"| {_n(i.get('p50'))} | {_n(o.get('itl_ms', {}).get('p99'))} | {_n(i.get('p99'))} "
                   f"| {_n(cpu.get('cores'), 2)} of {cpu.get('cpus', '?')} |")
    if aiperf.get("failed"):
        out += ["", f"AIPerf stopped early: {aiperf['failed']}"]
    return out


def write_plot(llm: dict, path: Path) -> str:
    """Latency (TTFT p50 and TPOT p50, ms) against output tokens/s, one point per concurrency,
    continuous batching on and (if measured) off; PNG at ``path``. Returns the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    series = [("continuous batching on", llm["levels"], "o-")]
    if llm.get("levels_static"):
        series.append(("continuous batching off", llm["levels_static"], "s--"))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms"), ("TTFT p50", "TPOT p50")):
        for label, levels, style in series:
            x = [lv["output_tokens_per_s"] for lv in levels]
            y = [lv[key]["p50"] for lv in levels]
            ax.plot(x, y, style, label=label)
            for xi, yi, lv in zip(x, y, levels):
                ax.annotate(f"c={lv['concurrency']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> str:
    """Write a matplotlib figure as a PNG at 100 dpi (the folder made first), close it, and return the
    file name the report links."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name
