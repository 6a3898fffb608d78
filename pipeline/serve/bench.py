"""Load sweeps against a running tritonserver (``recipe.serve`` sets the sizes).

Closed loop: at concurrency ``c``, ``c`` client threads (one connection each)
send the level's requests back to back, each waiting for its previous answer.
A level's duration runs from the first send to the last answer.

* LLM (causal-lm): streamed generations through the generation model, prompts
  = the validate stage's prompt token ids, ``serve.max_tokens`` output tokens
  with EOS ignored (every request the same length). Per level: TTFT, TPOT and
  inter-token latency percentiles, output tokens/s, requests/s, goodput. Then
  one request of ``serve.long_max_tokens`` tokens at concurrency 1 for TPOT at
  ``serve.tpot_positions`` and their ratio. The compute model's executed batch
  sizes during the sweep come from Triton's statistics: decode steps of
  different requests differ in past length, and they are neither bucketed nor
  padded, so only steps of equal shape can share a batch.
* Encoder: single inferences of the text -> embedding ensemble (held-out
  sentences): latency percentiles, inferences/s, goodput.
* Both: the compute model with dynamic batching off/on x 1/2 instances
  (:func:`pipeline.serve.prepare.write_variants`), loaded one at a time on the
  same server, under one bucketed workload: every request is batch 1 with
  every sequence axis ``serve.bucket_tokens`` long (for an LLM: a prefill with
  an empty past), so all requests can share a batch. Throughput ratios and the
  executed batch sizes read from the statistics extension.
"""
from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from pipeline.artifacts import TensorSpec
from pipeline.errors import PipelineError
from pipeline.serve.client import StreamClient, infer_ms, model_statistics, settled_statistics
from pipeline.serve.prepare import Served, Variant
from pipeline.serve.stats import batch_summary, latency_level, llm_level, ratio, stats_delta, tpot_at
from pipeline.triton.config import is_dynamic
from pipeline.triton.server import TritonServer

Log = Callable[[str], None]


def closed_loop(count: int, concurrency: int, connect: Callable[[], Any], work: Callable[[Any, int], Any]) -> tuple[list, float]:
    """Run ``work(connection, i)`` for i in 0..count-1 on ``concurrency`` threads.

    Each thread opens its connection (``connect()``; closed after with
    ``.close()``) before the clock starts. Returns the results in index order
    and the wall time in s from the start to the last answer.

    Raises:
        The first exception a worker raised (the others finish their request first).
    """
    results: list = [None] * count
    errors: list[BaseException] = []
    next_index = iter(range(count))
    lock = threading.Lock()

    def worker() -> None:
        connection = None
        try:
            connection = connect()
            ready.wait()
            while not errors:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                results[i] = work(connection, i)
        except threading.BrokenBarrierError:
            return
        except BaseException as e:  # reported to the caller below
            errors.append(e)
            ready.abort()
        finally:
            if connection is not None:
                connection.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, count))]
    ready = threading.Barrier(len(threads) + 1)
    for t in threads:
        t.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass  # a worker could not connect; its error is raised below
    start = time.perf_counter()
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    if errors:
        raise errors[0]
    return results, duration


def bucket_feeds(inputs: Sequence[TensorSpec], tokens: int, vocab: int) -> dict[str, np.ndarray]:
    """One request of batch 1 where every symbolic axis is ``tokens`` long, except
    ``past*`` axes (0: an LLM prefill). ``input_ids``: spread over ``[0, vocab)``;
    ``attention_mask``: ones; other inputs: zeros. Shapes include the batch axis."""
    feeds = {}
    for spec in inputs:
        shape = [_bucket_dim(axis, d, tokens) for axis, d in enumerate(spec.shape)]
        if spec.name == "input_ids":
            array = (np.arange(int(np.prod(shape))) * 7919 + 13) % vocab
        elif spec.name == "attention_mask":
            array = np.ones(shape)
        else:
            array = np.zeros(shape)
        feeds[spec.name] = array.reshape(shape).astype(spec.dtype)
    return feeds


def _bucket_dim(axis: int, dim: int | str, tokens: int) -> int:
    if not is_dynamic(dim):
        return int(dim)
    if axis == 0:
        return 1
    return 0 if "past" in str(dim) else tokens


def bench_llm(served: Served, server: TritonServer, log: Log) -> dict:
    """Concurrency sweep and TPOT by output position for a causal LM.

    Raises:
        PipelineError: the long request stopped before ``tpot_positions[1] + 4``
            tokens (the model's context limit); ServeClientError: an error response.
    """
    cfg, url = served.recipe.serve, server.grpc_url
    prompts = llm_prompts(served)
    with grpcclient.InferenceServerClient(url) as stats_client, StreamClient(url) as warm:
        counted = model_statistics(stats_client, served.compute_model)["inference_count"]
        counted += len(warm.generate(served.generate_model, input_ids=prompts[0], max_tokens=2).tokens)
        levels = []
        for c in cfg.concurrency:
            levels.append(llm_sweep_level(served, server, stats_client, counted, prompts, c, log))
            counted += levels[-1]["compute_batches"]["inferences"]
    log(f"TPOT by position: one request of {cfg.long_max_tokens} tokens at concurrency 1")
    with StreamClient(url) as client:
        long = client.generate(served.generate_model, input_ids=prompts[0], max_tokens=cfg.long_max_tokens,
                               ignore_eos=True)
    first, second = cfg.tpot_positions
    try:
        tpot = {str(p): tpot_at(long.gaps_ms, p) for p in (first, second)}
    except ValueError as e:
        raise PipelineError(f"serve.tpot_positions: {e}; the model stops at its context limit "
                            f"(prompt {len(prompts[0])} tokens); lower serve.long_max_tokens / tpot_positions") from e
    positions = {"tokens": len(long.tokens), "tpot_ms": tpot, "ratio": ratio(tpot[str(second)], tpot[str(first)]),
                 "ttft_ms": long.ttft_ms, "gaps_ms": [round(g, 2) for g in long.gaps_ms]}
    return {"kind": "llm", "prompt_tokens": len(prompts[0]), "levels": levels, "tpot_by_position": positions}


def llm_sweep_level(served: Served, server: TritonServer, stats_client: grpcclient.InferenceServerClient,
                    counted: int, prompts: list[list[int]], concurrency: int, log: Log) -> dict:
    """One level: ``serve.requests_per_level`` generations at ``concurrency``. ``counted``:
    compute-model inferences made before it; statistics are read once they include those,
    and after, once they include one compute call per generated token."""
    cfg, model = served.recipe.serve, served.compute_model
    log(f"concurrency {concurrency}: {cfg.requests_per_level} streamed requests x {cfg.max_tokens} tokens")
    before = settled_statistics(stats_client, model, counted)
    gens, duration = closed_loop(
        cfg.requests_per_level, concurrency, lambda: StreamClient(server.grpc_url),
        lambda client, i: client.generate(served.generate_model, input_ids=prompts[i % len(prompts)],
                                          max_tokens=cfg.max_tokens, ignore_eos=True),
    )
    calls = sum(len(g.tokens) for g in gens)  # the prefill makes token 1, each decode step one more
    delta = stats_delta(before, settled_statistics(stats_client, model, before["inference_count"] + calls))
    return {"concurrency": concurrency, **llm_level(gens, duration, cfg.slo),
            "compute_batches": batch_summary(delta, duration)}


def llm_prompts(served: Served) -> list[list[int]]:
    """The validate stage's prompt token ids; else 8 prompts of 16 tokens from the validate split."""
    ids = served.artifacts["validate"].greedy_tokens.get("prompt_ids")
    if ids:
        return [list(p) for p in ids]
    from pipeline import data
    from pipeline.models.registry import load_tokenizer

    v = served.recipe.validate_
    tok = load_tokenizer(served.artifacts["export"].tokenizer_dir)
    return data.prompts(tok, data.load_documents(v.dataset, v.split), 8).tolist()


def bench_encoder(served: Served, server: TritonServer, log: Log) -> dict:
    """Concurrency sweep of the text -> embedding ensemble (single sentences)."""
    cfg, model = served.recipe.serve, str(served.ensemble_model)
    sentences = held_out_sentences(served)
    feeds = [{"text": np.array([[s.encode()]], dtype=np.object_)} for s in sentences]
    levels = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        counted = model_statistics(client, served.compute_model)["inference_count"] + 1
        infer_ms(client, model, feeds[0])
        for c in cfg.concurrency:
            log(f"concurrency {c}: {cfg.requests_per_level} requests to {model}")
            before = settled_statistics(client, served.compute_model, counted)
            latencies, duration = closed_loop(
                cfg.requests_per_level, c, lambda: grpcclient.InferenceServerClient(server.grpc_url),
                lambda conn, i: infer_ms(conn, model, feeds[i % len(feeds)]),
            )
            counted = before["inference_count"] + cfg.requests_per_level
            delta = stats_delta(before, settled_statistics(client, served.compute_model, counted))
            levels.append({"concurrency": c, **latency_level(latencies, duration, cfg.slo.latency_ms),
                           "compute_batches": batch_summary(delta, duration)})
    return {"kind": "encoder", "model": model, "sentences": len(sentences), "levels": levels}


def held_out_sentences(served: Served, limit: int = 64) -> list[str]:
    """Sentences (20..300 characters) of the recipe's validate split."""
    from pipeline import data

    v = served.recipe.validate_
    pieces = (s.strip() for doc in data.load_documents(v.dataset, v.split) for s in re.split(r"(?<=[.!?])\s+", doc))
    return [s for s in pieces if 20 <= len(s) <= 300][:limit] or ["A short sentence to embed."]


def bench_variants(served: Served, server: TritonServer, variants: Sequence[Variant], log: Log) -> dict:
    """The bucketed workload on each variant (loaded, measured, unloaded in turn) and the ratios."""
    cfg = served.recipe.serve
    feeds = bucket_feeds(served.artifacts["export"].inputs, cfg.bucket_tokens, vocab_size(served))
    shapes = {n: list(a.shape) for n, a in feeds.items() if "past" not in n}
    rows = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for v in variants:
            log(f"{v.name}: {cfg.batching_requests} requests at concurrency {cfg.batching_concurrency}, shapes {shapes}")
            rows.append(variant_row(client, server.grpc_url, v, feeds, cfg.batching_requests, cfg.batching_concurrency))
    by = {(r["dynamic_batching"], r["instances"]): r["inferences_per_s"] for r in rows}
    ratios = {
        "dynamic_batching_on_over_off_1_instance": ratio(by.get((True, 1), 0), by.get((False, 1), 0)),
        "dynamic_batching_on_over_off_2_instances": ratio(by.get((True, 2), 0), by.get((False, 2), 0)),
        "instances_2_over_1_batching_off": ratio(by.get((False, 2), 0), by.get((False, 1), 0)),
        "instances_2_over_1_batching_on": ratio(by.get((True, 2), 0), by.get((True, 1), 0)),
    }
    return {"bucket_shapes": shapes, "empty_past": len(shapes) < len(feeds),
            "concurrency": cfg.batching_concurrency, "requests": cfg.batching_requests,
            "max_batch_size": served.recipe.triton.max_batch_size, "variants": rows, "ratios": ratios}


def variant_row(client: grpcclient.InferenceServerClient, url: str, v: Variant, feeds: dict[str, np.ndarray],
                requests: int, concurrency: int) -> dict:
    """Load ``v``, warm it up (one request, not counted), run the closed loop, read the
    statistics delta, unload it. Latency in ms, throughput in inferences/s."""
    client.load_model(v.name)
    try:
        counted = model_statistics(client, v.name)["inference_count"] + 1
        infer_ms(client, v.name, feeds)
        before = settled_statistics(client, v.name, counted)
        latencies, duration = closed_loop(requests, concurrency, lambda: grpcclient.InferenceServerClient(url),
                                          lambda conn, i: infer_ms(conn, v.name, feeds))
        delta = stats_delta(before, settled_statistics(client, v.name, before["inference_count"] + requests))
    finally:
        client.unload_model(v.name)
        wait_unloaded(client, v.name)
    level = latency_level(latencies, duration, float("inf"))
    for key in ("goodput_rps", "slo_met"):  # no SLO in this comparison
        level.pop(key)
    return {"variant": v.name, "dynamic_batching": v.dynamic_batching, "instances": v.instances,
            **level, "batches": batch_summary(delta, duration)}


def wait_unloaded(client: grpcclient.InferenceServerClient, model: str, timeout_s: float = 60.0) -> None:
    """Poll until ``model`` is no longer ready (its instances' memory is released), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while client.is_model_ready(model) and time.monotonic() < deadline:
        time.sleep(0.2)


def vocab_size(served: Served) -> int:
    """Vocabulary size of the export's tokenizer (tokenizer.json, added tokens included)."""
    from tokenizers import Tokenizer

    path = Path(served.artifacts["export"].tokenizer_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def environment(server: TritonServer) -> dict:
    """Server version, CPU count and load average (the CPU may be shared; numbers depend on it)."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        version = client.get_server_metadata(as_json=True).get("version", "?")
    return {"tritonserver": version, "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
