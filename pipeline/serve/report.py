"""Markdown tables of a bench result (the dict :func:`pipeline.serve.run.bench` writes as JSON)."""
from __future__ import annotations

import math


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
    return "\n".join(lines) + "\n"


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
    out += [
        "",
        f"TPOT by output position (one request, {pos['tokens']} tokens, concurrency 1; median gap of 8 positions): "
        f"~{first}: {_n(pos['tpot_ms'][str(first)])} ms, ~{second}: {_n(pos['tpot_ms'][str(second)])} ms, "
        f"ratio {second}/{first} = **{_n(pos['ratio'], 2)}** (KV cache: near 1; recomputing the prefix would grow "
        "with position).",
        "",
        "Compute-model executions by batch size during the sweep (Triton statistics). Decode steps of different "
        "requests have different past lengths and are not padded or bucketed, so only equal shapes share a batch:",
        "",
        "| concurrency | executions by batch size | mean batch |",
        "|---:|---|---:|",
    ]
    out += [f"| {lv['concurrency']} | {_batches(lv['compute_batches'])} | {_n(lv['compute_batches']['mean_batch'], 2)} |"
            for lv in llm["levels"]]
    return out + [""]


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
