"""Load sweeps against a running tritonserver (``recipe.serve`` sets the sizes).

Closed loop: at concurrency ``c``, ``c`` client threads (one connection each)
send the level's requests back to back, each waiting for its previous answer.
A level's duration runs from the first send to the last answer.

* Generation kinds (text-generation): streamed generations through the generation model, prompts
  = the validate stage's prompt token ids, ``serve.max_tokens`` output tokens
  with EOS ignored (every request the same length). Per level: TTFT, TPOT and
  inter-token latency percentiles, output tokens/s, requests/s, goodput. Then
  ``serve.long_requests`` requests of ``serve.long_max_tokens`` tokens, one after
  another, for TPOT at ``serve.tpot_positions`` (median over the requests) and
  their ratio. The compute model's executed batch sizes during the sweep come
  from Triton's statistics: decode steps of different requests differ in past
  length, and they are neither bucketed nor padded, so only steps of equal shape
  can share a batch.
* Other kinds (sentence-embedding: the text -> embedding ensemble): single
  inferences of the front model with the kind's bench workload (validate's
  held-out samples): latency percentiles, inferences/s, goodput.
* Both: the compute model with dynamic batching off/on x 1/2 instances
  (:func:`pipeline.serve.prepare.write_variants`), loaded one at a time on the
  same server, under one bucketed workload: every request is batch 1 with
  every sequence axis ``serve.bucket_tokens`` long (for an LLM: a prefill with
  an empty past), so all requests can share a batch. Throughput ratios and the
  executed batch sizes read from the statistics extension.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import resource
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from pipeline.artifacts import TensorSpec
from pipeline.errors import EnvironmentFault, PipelineError
from pipeline.serve.client import (
    ServeClientError,
    StreamClient,
    infer_ms,
    model_statistics,
    scheduler_statistics,
    settled_statistics,
)
from pipeline.serve.prepare import Served, Variant
from pipeline.serve.stats import batch_summary, latency_level, llm_level, ratio, stats_delta, tpot_by_position
from pipeline.triton.config import is_dynamic
from pipeline.triton.server import TritonServer
from pipeline.recipe.kinds import KV_PAST_RE, KV_PRESENT_RE, past_name
from pipeline.sources.model import load_tokenizer

Log = Callable[[str], None]


def closed_loop(count: int, concurrency: int, connect: Callable[[], Any], work: Callable[[Any, int], Any], *,
                min_duration_s: float | None = None, nice: int = 0,
                cpu_s: list[float] | None = None) -> tuple[list, float]:
    """Run ``work(connection, i)`` for i in 0..count-1 on ``concurrency`` threads.

    Each thread opens its connection (``connect()``; closed after with
    ``.close()``) before the clock starts. Returns the results in index order
    and the wall time in s from the start to the last answer. With ``min_duration_s``
    (``tune-serving``'s measurements) the threads go on past ``count`` requests, i = count,
    count + 1, ..., until that many seconds have passed since the start. ``nice`` > 0: each
    thread first lowers its own CPU priority by that much (:func:`lower_thread_priority`); ``cpu_s``:
    each thread appends its own CPU time (``time.thread_time``, connect and close included), s.

    Raises:
        The first exception a worker raised (the others finish their request first).
    """
    results: dict[int, Any] = {}
    errors: list[BaseException] = []
    next_index = itertools.count()
    lock = threading.Lock()
    started: list[float] = []

    def more(i: int) -> bool:
        if i < count:
            return True
        return min_duration_s is not None and (not started or time.perf_counter() - started[0] < min_duration_s)

    def worker() -> None:
        connection, cpu_start = None, time.thread_time()
        try:
            if nice:
                lower_thread_priority(nice)
            connection = connect()
            ready.wait()
            while not errors:
                with lock:
                    i = next(next_index)
                    if not more(i):
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
            if cpu_s is not None:
                cpu_s.append(time.thread_time() - cpu_start)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, count))]
    ready = threading.Barrier(len(threads) + 1)
    for t in threads:
        t.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass  # a worker could not connect; its error is raised below
    start = time.perf_counter()
    started.append(start)
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    if errors:
        raise errors[0]
    return [results[i] for i in sorted(results)], duration


def lower_thread_priority(by: int) -> int:
    """Raise the calling thread's nice value by ``by`` (Linux: ``setpriority(PRIO_PROCESS, tid)``
    sets one thread's; raising it needs no privilege; the kernel caps it at 19). Returns the new value.
    Load threads niced so yield the CPU to the server first, as ``nice -n <by>`` does for a whole client
    process: the AIPerf cross-check runs both clients so (:data:`pipeline.serve.crosscheck.CLIENT_NICE`).

    Raises:
        OSError: the platform has no per-thread priorities (not Linux) or refused.
    """
    tid = threading.get_native_id()
    value = os.getpriority(os.PRIO_PROCESS, tid) + by
    os.setpriority(os.PRIO_PROCESS, tid, value)
    return os.getpriority(os.PRIO_PROCESS, tid)


def open_loop(rate_rps: float, count: int, connect: Callable[[], Any], work: Callable[[Any, int], Any], *,
              max_in_flight: int = 64) -> tuple[list, float, int]:
    """Send request i at ``i / rate_rps`` s after the start (fixed intervals, open loop: a send does
    not wait for earlier answers), on up to ``max_in_flight`` threads, each with its own connection
    (``connect()``, closed at the end). Returns the results of ``work(connection, i)`` in index
    order, the wall time in s from the start to the last answer, and how many sends started over
    10 ms late (every thread busy: the offered rate was not reached, and their latency is the
    server's from the actual send).

    Raises:
        The first exception a request raised (after the others finish).
    """
    import concurrent.futures

    local = threading.local()
    opened: list = []
    lock = threading.Lock()
    late = [0]

    def run(i: int, due: float) -> Any:
        if not hasattr(local, "conn"):
            local.conn = connect()
            with lock:
                opened.append(local.conn)
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        elif wait < -0.010:
            with lock:
                late[0] += 1
        return work(local.conn, i)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_in_flight)
    try:
        start = time.perf_counter()
        futures = [pool.submit(run, i, start + i / rate_rps) for i in range(count)]
        results = [f.result() for f in futures]
        duration = time.perf_counter() - start
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for conn in opened:
            conn.close()
    return results, duration, late[0]


def bucket_feeds(inputs: Sequence[TensorSpec], tokens: int, vocab: int | None) -> dict[str, np.ndarray]:
    """One request of batch 1 where every symbolic axis is ``tokens`` long, except
    ``past*`` axes (0: an LLM prefill). ``input_ids``: spread over ``[0, vocab)`` (zeros
    without a vocabulary); ``attention_mask``: ones; other inputs: zeros. Shapes include
    the batch axis."""
    feeds = {}
    for spec in inputs:
        shape = [_bucket_dim(axis, d, tokens) for axis, d in enumerate(spec.shape)]
        if spec.name == "input_ids" and vocab:
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


def bench_llm(served: Served, server: TritonServer, log: Log, static: StaticVariant | None = None) -> dict:
    """Concurrency sweep and TPOT by output position for a causal LM; with ``static`` (the
    generation model with the other ``triton.continuous_batching`` setting, in a repository
    the server was started with) the same sweep on it: ``levels`` = continuous batching on,
    ``levels_static`` = off.

    Raises:
        PipelineError: a long request stopped before ``tpot_positions[1] + 4``
            tokens (the model's context limit); ServeClientError: an error response.
    """
    cfg, url = served.recipe.serve, server.grpc_url
    prompts = llm_prompts(served)
    batching_on = getattr(served.recipe.triton, "continuous_batching", None)
    with grpcclient.InferenceServerClient(url) as stats_client:
        served_levels = llm_sweep(served, server, stats_client, served.generate_model, prompts, log)
        other = None
        if static is not None:
            stats_client.load_model(static.name)
            try:
                other = llm_sweep(served, server, stats_client, static.name, prompts, log)
            finally:
                stats_client.unload_model(static.name)
                wait_unloaded(stats_client, static.name)
    log(f"TPOT by position: {cfg.long_requests} requests of {cfg.long_max_tokens} tokens, one after another")
    longs = []
    for _ in range(cfg.long_requests):
        with StreamClient(url) as client:
            longs.append(client.generate(served.generate_model, input_ids=prompts[0],
                                         max_tokens=cfg.long_max_tokens, ignore_eos=True))
    try:
        positions = tpot_by_position(longs, cfg.tpot_positions)
    except ValueError as e:
        raise PipelineError(f"serve.tpot_positions: {e}; the model stops at its context limit "
                            f"(prompt {len(prompts[0])} tokens); lower serve.long_max_tokens / tpot_positions") from e
    out = {"kind": "llm", "prompt_tokens": len(prompts[0]), "continuous_batching": batching_on,
           "levels": served_levels, "tpot_by_position": positions,
           "serving_overhead": serving_overhead(served, server, prompts[0], log)}
    if other is not None:  # levels: continuous batching on; levels_static: off
        out["levels"], out["levels_static"] = (served_levels, other) if batching_on else (other, served_levels)
        out["continuous_batching"] = True
        out["static_model"] = static.name if batching_on else served.generate_model
        out["batching_speedup"] = {str(a["concurrency"]): ratio(a["output_tokens_per_s"], b["output_tokens_per_s"])
                                   for a, b in zip(out["levels"], out["levels_static"])}
    else:
        out["levels_static_skipped"] = ("the recipe has no triton.continuous_batching field" if batching_on is None
                                        else "the generation model's config has no continuous_batching parameter")
    return out


def serving_overhead(served: Served, server: TritonServer, prompt: list[int], log: Log) -> dict:
    """Served batch-1 TPOT against the served graph's own decode step, measured side by side:
    one streamed request of ``serve.max_tokens`` tokens (EOS ignored), then the graph alone in
    ONNX Runtime in this process (:func:`graph_decode_ms`) at the same contexts, then the request
    again. Times in ms; ``ratio`` = median TPOT of the two requests / median graph step (target <= 1.15). ``{"skipped": why}`` for targets whose graph is not ONNX Runtime's."""
    graph = served_graph(served)
    if graph is None:
        return {"skipped": f"target {served.target!r}: the served graph does not run in ONNX Runtime here"}
    cfg = served.recipe.serve
    log(f"serving overhead: batch-1 TPOT of {served.generate_model} vs {graph.name} alone in ONNX Runtime")

    def tpot() -> float:
        with StreamClient(server.grpc_url) as client:
            gen = client.generate(served.generate_model, input_ids=prompt, max_tokens=cfg.max_tokens, ignore_eos=True)
        return float(np.median(gen.gaps_ms))

    before = tpot()
    steps = graph_decode_ms(graph, prompt, max(1, cfg.max_tokens - 1))
    after = tpot()
    served_ms, graph_ms = float(np.median([before, after])), float(np.median(steps))
    return {"served_tpot_ms": served_ms, "served_tpot_ms_before_after": [before, after],
            "graph_step_ms": graph_ms, "ratio": ratio(served_ms, graph_ms), "graph": str(graph),
            "contexts": [len(prompt) + 1, len(prompt) + cfg.max_tokens - 1]}


def graph_decode_ms(graph: Path, prompt: list[int], steps: int) -> list[float]:
    """Greedy batch-1 decoding of ``prompt`` with the graph alone, as the python-onnxruntime model
    runs it (weight Q/DQ dequantized once, its ONNX Runtime level): a prefill, then ``steps``
    one-token steps fed with the returned KV cache; each step's ms."""
    from pipeline.plan.measure import _served_weights, _session

    weights, model = _served_weights(graph)
    session = _session(model, weights)
    outputs = [o.name for o in session.get_outputs()]
    logits = "last_logits" if "last_logits" in outputs else "logits"
    names = [n for n in outputs if KV_PRESENT_RE.match(n)]
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float16 if "float16" in i.type else np.float32)
            for i in session.get_inputs() if KV_PAST_RE.match(i.name)}
    ids, times = list(prompt), []
    for step in range(steps + 1):
        feeds = {"input_ids": np.array([ids], np.int64),
                 "attention_mask": np.ones((1, len(prompt) + step), np.int64), **weights, **past}
        start = time.perf_counter()
        result = dict(zip([logits, *names], session.run([logits, *names], feeds)))
        if step:  # step 0 is the prefill
            times.append((time.perf_counter() - start) * 1e3)
        ids = [int(np.argmax(result[logits].reshape(-1, result[logits].shape[-1])[-1]))]
        past = {past_name(n): result[n] for n in names}
    return times


def served_graph(served: Served) -> Path | None:
    """The ONNX file of a python-onnxruntime compute model (config ``onnx_file``), else None."""
    from pipeline.triton.config import parse_config

    if served.target != "python-onnxruntime":
        return None
    folder = served.repository / served.compute_model
    params = parse_config((folder / "config.pbtxt").read_text()).parameters
    name = params["onnx_file"].string_value if "onnx_file" in params else "model.onnx"
    path = folder / str(served.recipe.triton.version) / name
    return path if path.is_file() else None


def llm_sweep(served: Served, server: TritonServer, stats_client: grpcclient.InferenceServerClient, model: str,
              prompts: list[list[int]], log: Log) -> list[dict]:
    """One warm-up request, then :func:`llm_sweep_level` at each ``serve.concurrency`` on ``model``."""
    counted = model_statistics(stats_client, served.compute_model)["inference_count"]
    with StreamClient(server.grpc_url) as warm:
        counted += len(warm.generate(model, input_ids=prompts[0], max_tokens=2).tokens)
    levels = []
    for c in served.recipe.serve.concurrency:
        levels.append(llm_sweep_level(served, server, stats_client, counted, prompts, c, log, model=model))
        counted = levels[-1]["compute_batches"].pop("_counted")
    return levels


def llm_sweep_level(served: Served, server: TritonServer, stats_client: grpcclient.InferenceServerClient,
                    counted: int, prompts: list[list[int]], concurrency: int, log: Log,
                    model: str | None = None) -> dict:
    """One level: ``serve.requests_per_level`` generations at ``concurrency`` on ``model``
    (default the generation model). ``counted``: compute-model inferences made before it;
    statistics are read once they include those, and after, once they include one compute
    call per generated token (or after a short wait: a scheduler that batches or keeps the
    graph in-process counts differently). ``compute_batches["_counted"]``: the count read after.
    A generation model that runs the graph in its own process (:attr:`Served.compute_in_process`)
    is never counted there: the statistics are read at once (each wait took 5 s a level)."""
    cfg, compute, model = served.recipe.serve, served.compute_model, model or served.generate_model
    log(f"{model}: concurrency {concurrency}: {cfg.requests_per_level} streamed requests x {cfg.max_tokens} tokens")
    wait_s = 0.0 if served.compute_in_process else 5.0
    before = _statistics_at_least(stats_client, compute, counted, wait_s)
    has_stats = "scheduler_stats" in {i.name for i in stats_client.get_model_metadata(model).inputs}
    sched_before = scheduler_statistics(server.grpc_url, model) if has_stats else None
    gens, duration = closed_loop(
        cfg.requests_per_level, concurrency, lambda: StreamClient(server.grpc_url),
        lambda client, i: client.generate(model, input_ids=prompts[i % len(prompts)],
                                          max_tokens=cfg.max_tokens, ignore_eos=True),
    )
    calls = sum(len(g.tokens) for g in gens)  # the prefill makes token 1, each decode step one more
    after = _statistics_at_least(stats_client, compute, before["inference_count"] + calls, wait_s)
    batches = batch_summary(stats_delta(before, after), duration)
    batches["_counted"] = after["inference_count"]
    level = {"concurrency": concurrency, "model": model, **llm_level(gens, duration, cfg.slo),
             "compute_batches": batches}
    if sched_before is not None:
        sched_after = scheduler_statistics(server.grpc_url, model)
        if sched_after is not None:
            level["scheduler_batches"] = scheduler_delta(sched_before, sched_after)
    return level


def scheduler_delta(before: dict, after: dict) -> dict:
    """Steps of the generation model's scheduler between two ``scheduler_stats`` readings:
    ``executions_by_batch_size`` {size (str): steps}, ``steps``, ``mean_batch`` (sequences per step)."""
    sizes = {k: n - int(before["executions_by_batch_size"].get(k, 0))
             for k, n in after["executions_by_batch_size"].items()}
    sizes = {k: n for k, n in sorted(sizes.items(), key=lambda kv: int(kv[0])) if n > 0}
    steps = sum(sizes.values())
    return {"executions_by_batch_size": sizes, "steps": steps,
            "mean_batch": sum(int(k) * n for k, n in sizes.items()) / steps if steps else 0.0}


def _statistics_at_least(client: grpcclient.InferenceServerClient, model: str, count: int,
                         timeout_s: float = 5.0) -> dict:
    """:func:`settled_statistics`, or the current reading when the count is not reached in ``timeout_s``."""
    try:
        return settled_statistics(client, model, count, timeout_s=timeout_s)
    except ServeClientError:
        return model_statistics(client, model)


@dataclass(frozen=True)
class StaticVariant:
    """The generation model with the other continuous-batching setting, in its own repository."""

    name: str
    repository: Path
    continuous_batching: bool


def write_static_variant(served: Served) -> StaticVariant | None:
    """Copy the served generation model to ``<run dir>/bench_repository/<model>__cb_off`` (or
    ``__cb_on``) with the config parameter ``continuous_batching`` flipped and the model renamed;
    it calls the same compute model. None when the recipe or the config has no such setting.

    Raises:
        PipelineError: the served generation model's config.pbtxt cannot be parsed.
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    batching_on = getattr(served.recipe.triton, "continuous_batching", None)
    if not served.generate_model or batching_on is None:
        return None
    source = served.repository / served.generate_model
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse((source / "config.pbtxt").read_text(), config)
    except (OSError, text_format.ParseError) as e:
        raise PipelineError(f"{source / 'config.pbtxt'}: cannot read the generation model's config ({e})") from e
    if "continuous_batching" not in config.parameters:
        return None
    name = f"{served.generate_model}__cb_{'off' if batching_on else 'on'}"
    root = served.run_dir / "bench_repository" / name
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("config.pbtxt", "__pycache__"))
    config.name = name
    config.parameters["continuous_batching"].string_value = "0" if batching_on else "1"
    for key in ("compute_onnx",):  # a path relative to the repository: the variant lives elsewhere
        if key in config.parameters and not Path(config.parameters[key].string_value).is_absolute():
            config.parameters[key].string_value = str((served.repository / config.parameters[key].string_value)
                                                      .resolve())
    (root / name / "config.pbtxt").write_text(text_format.MessageToString(config))
    return StaticVariant(name, root, not batching_on)


def llm_prompts(served: Served) -> list[list[int]]:
    """The validate stage's prompt token ids; else the kind's bench workload (the same
    choice of validate prompts, :meth:`ModelAdapter.bench_workload`)."""
    ids = served.artifacts["validate"].greedy_tokens.get("prompt_ids")
    if ids:
        return [list(p) for p in ids]
    workload = served.adapter.bench_workload(served.recipe, served.artifacts["export"].tokenizer_dir)
    return [r["input_ids"].tolist() for r in workload.requests]


def llm_prompt_texts(served: Served) -> tuple[list[str], list[int]]:
    """:func:`llm_prompts` as text for an HTTP client (the AIPerf cross-check's route): each prompt's ids
    decoded with the served generation model's tokenizer.json (special tokens kept), and the number
    of tokens each text encodes to again with it, as the OpenAI endpoint counts a text prompt."""
    from tokenizers import Tokenizer

    from pipeline.serve.openai.app import find_model_folder

    tok = Tokenizer.from_file(str(find_model_folder(served.repository, str(served.generate_model)) / "tokenizer.json"))
    texts = [tok.decode(p, skip_special_tokens=False) for p in llm_prompts(served)]
    return texts, [len(tok.encode(t).ids) for t in texts]


def bench_encoder(served: Served, server: TritonServer, log: Log) -> dict:
    """Concurrency sweep of the front model (an ensemble: one response per request) with the
    kind's bench workload (:meth:`ModelAdapter.bench_workload`: validate's held-out samples)."""
    cfg, model = served.recipe.serve, str(served.ensemble_model)
    workload = served.adapter.bench_workload(served.recipe, served.artifacts["export"].tokenizer_dir)
    feeds = workload.requests
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
    return {"kind": "encoder", "model": model, "sentences": len(feeds), "workload": workload.describe,
            "levels": levels}


def bench_variants(served: Served, server: TritonServer, variants: Sequence[Variant], log: Log) -> dict:
    """The bucketed workload on each variant (loaded, measured, unloaded in turn) and the ratios."""
    cfg = served.recipe.serve
    feeds = bucket_feeds(served.artifacts["export"].inputs, cfg.bucket_tokens, vocab_size(served))
    shapes = {n: list(a.shape) for n, a in feeds.items() if "past" not in n}
    said = ", ".join(f"{n} {'x'.join(map(str, shape))}" for n, shape in shapes.items())
    rows = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for v in variants:
            log(f"{v.name}: {cfg.batching_requests} requests at concurrency {cfg.batching_concurrency} ({said})")
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


def vocab_size(served: Served) -> int | None:
    """Vocabulary size of the export's tokenizer (tokenizer.json, added tokens included);
    None for a model without one (the generic kind)."""
    from tokenizers import Tokenizer

    folder = served.artifacts["export"].tokenizer_dir
    path = Path(folder) / "tokenizer.json" if folder else None
    if path is None or not path.is_file():
        return None
    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def environment(server: TritonServer) -> dict:
    """Server version, CPU count and load average (the CPU may be shared; numbers depend on it)."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        version = client.get_server_metadata(as_json=True).get("version", "?")
    return {"tritonserver": version, "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}


def openai_generate(base_url: str, model: str) -> Callable[[list[int], int], tuple[list[int], str]]:
    """A :data:`pipeline.serve.check.Generate` through the OpenAI endpoint with the official ``openai``
    client: ``/v1/completions`` with the prompt as token ids, ``temperature: 0``, and the endpoint's
    ``return_token_ids`` extension for the generated ids."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    def generate(prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        extra_body={"return_token_ids": True})
        choice = out.choices[0]
        return [int(t) for t in (choice.model_extra or {}).get("token_ids") or []], str(choice.finish_reason)
    return generate


def bench_client_agreement(served: Served, base_url: str, log: Log) -> dict:
    """The validate prompts through the OpenAI endpoint (:func:`openai_generate`) at each
    ``serve.concurrency``, against the validate stage's greedy tokens of the quantized graph
    (:func:`pipeline.serve.check.check_greedy`: exact at concurrency 1; batched, equal up to the
    batch-1 reference's first near tie, top-2 logit gap < ``TIE_TOLERANCE``). Per level:
    ``agreement`` (validate tokens matched at their position / validate tokens), ``equal``,
    ``tie_excused`` and ``mismatches`` (prompt index and verdict); ``failures``: every mismatch.
    ``perplexity``: :func:`echo_perplexity`."""
    from pipeline.serve.check import TIE_TOLERANCE, check_greedy

    precision = served.artifacts["quantize"].precision
    if precision not in served.artifacts["validate"].greedy_tokens:
        return {"skipped": f"the validate stage recorded no {precision} greedy tokens (validate.generation)"}
    model = str(served.generate_model)
    send = openai_generate(base_url, model)
    levels, failures = [], []
    for c in served.recipe.serve.concurrency:
        log(f"openai client: validate prompts at temperature 0, concurrency {c}")
        checks = check_greedy(served, "", concurrency=c, generate=send)
        total = sum(len(k.expected) for k in checks)
        same = sum(a == b for k in checks for a, b in zip(k.streamed, k.expected))
        bad = [{"prompt": k.index, "verdict": k.verdict} for k in checks if not k.ok]
        failures += [{"concurrency": c, **b} for b in bad]
        levels.append({"concurrency": c, "prompts": len(checks), "agreement": same / total if total else 1.0,
                       "equal": sum(k.streamed == k.expected for k in checks),
                       "tie_excused": [k.index for k in checks if k.tie_excused], "mismatches": bad})
    return {"client": f"openai {_version('openai')}", "precision": served.artifacts["quantize"].precision,
            "tie_tolerance": TIE_TOLERANCE, "levels": levels, "failures": failures,
            "perplexity": echo_perplexity(served, base_url, log)}


def echo_perplexity(served: Served, base_url: str, log: Log) -> dict:
    """Perplexity of the validate windows (:func:`pipeline.models.text.token_windows`, as validate cuts
    them) from the endpoint's prompt logprobs, with the ``openai`` client in OpenAI's documented
    shape: ``/v1/completions`` with ``echo: true, logprobs: 0, max_tokens: 1``, the window as token
    ids; ``choices[0].logprobs.token_logprobs`` holds log p(token | earlier tokens) per prompt
    token (None first). Scored from the position validate scores from. Returns ``{"perplexity",
    "validate" (validate's perplexity of the same graph), "relative_difference", "windows"}``, or
    ``{"skipped": why}`` when the endpoint returns no prompt logprobs."""
    import math

    import openai

    from pipeline.models import text as data

    v, precision = served.recipe.validate_, served.artifacts["quantize"].precision
    tok = load_tokenizer(served.artifacts["export"].tokenizer_dir)
    windows = data.token_windows(tok, data.documents(v.data), v.seq_len, v.max_windows)
    context = v.seq_len - data.window_convention(tok, v.seq_len)["scored_per_window"]
    if len(windows) == 0:
        return {"skipped": f"validate.data gives no window of {v.seq_len} tokens"}
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    log(f"openai client: perplexity of {len(windows)} validate windows from echo logprobs")
    total, count = 0.0, 0
    for window in windows:
        try:
            out = client.completions.create(model=str(served.generate_model), prompt=[int(t) for t in window],
                                            max_tokens=1, temperature=0, echo=True, logprobs=0)
        except openai.APIStatusError as e:
            return {"skipped": f"the endpoint answered {e.status_code} to echo: true, logprobs: 0 ({e.message})"}
        lp = out.choices[0].logprobs
        scored = (lp.token_logprobs or [])[context:len(window)] if lp is not None else []
        if len(scored) != len(window) - context or any(x is None for x in scored):
            return {"skipped": "the endpoint returned no prompt logprobs for echo: true, logprobs: 0"}
        total, count = total - float(sum(scored)), count + len(scored)
    ppl, ref = math.exp(total / count), served.artifacts["validate"].metrics.get(f"perplexity_{precision}")
    return {"perplexity": ppl, "validate": ref, "windows": len(windows), "scored_tokens": count,
            "relative_difference": (ppl - ref) / ref if ref else None}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


#: AIPerf metrics put next to ours (its profile_export_aiperf.json keys), ms.
AIPERF_METRICS = ("time_to_first_token", "inter_token_latency", "output_token_throughput", "request_latency")


def bench_aiperf(served: Served, endpoint_url: str, out_dir: Path, log: Log, timeout_s: float = 1800.0) -> dict:
    """Drive the OpenAI endpoint with AIPerf's CLI (streaming completions) at each ``serve.concurrency``:
    ``serve.requests_per_level`` synthetic prompts of the bench's prompt length, ``serve.max_tokens``
    output tokens, EOS ignored (:func:`aiperf_llm_command`), each run through :func:`run_aiperf`.

    Returns ``{"levels": [{"concurrency", "time_to_first_token": {"avg","p50","p90","p99"} ms,
    "inter_token_latency": ..., ..., "client_cpu"}], "command": [...]}``; ``{"skipped": reason}``
    without the CLI; ``{"failed": why, "command", "levels"}`` (the levels before it) when AIPerf exits
    non-zero, writes no export, or reports any request that failed (AIPerf 0.5 then still exits 0).
    """
    exe = aiperf_exe()
    if exe is None:
        return {"skipped": "the aiperf CLI is not installed (pip install aiperf)"}
    cfg = served.recipe.serve
    levels: list[dict] = []
    command: list[str] = []
    for c in cfg.concurrency:
        folder = out_dir / f"c{c}"
        command = aiperf_llm_command(exe, served, endpoint_url, c, cfg.requests_per_level, folder)
        log(f"aiperf: concurrency {c}: {cfg.requests_per_level} streamed requests x {cfg.max_tokens} tokens")
        done = run_aiperf(command, folder, timeout_s, where=f"concurrency {c}")
        if "failed" in done:
            log(f"aiperf failed: {done['failed']}")
            return {"failed": done["failed"], "command": command, "levels": levels}
        levels.append({"concurrency": c, **aiperf_metrics(done["export"]), "client_cpu": done["client_cpu"]})
    return {"levels": levels, "command": command}


def aiperf_exe() -> str | None:
    """The ``aiperf`` CLI: on PATH, else beside this Python; None when neither has it."""
    import sys

    exe = shutil.which("aiperf") or str(Path(sys.executable).with_name("aiperf"))
    return exe if Path(exe).is_file() else None


def aiperf_llm_command(exe: str, served: Served, endpoint_url: str, concurrency: int, requests: int, folder: Path,
                       *, warmup: int = 0) -> list[str]:
    """AIPerf's command for streamed ``/v1/completions`` through the OpenAI endpoint (``endpoint_url``,
    ending in ``/v1``): ``requests`` synthetic prompts of the bench's prompt length (the first validate
    prompt's), ``serve.max_tokens`` output tokens with EOS ignored, at ``concurrency``, after ``warmup``
    uncounted requests (0: none). Offline: ``--tokenizer`` is the served generation model's folder,
    which AIPerf 0.5 loads with ``AutoTokenizer.from_pretrained`` (no hub)."""
    from pipeline.serve.openai.app import find_model_folder

    cfg = served.recipe.serve
    tokenizer = str(find_model_folder(served.repository, str(served.generate_model)).resolve())
    isl = len(llm_prompts(served)[0])
    return [exe, "profile", "--model", str(served.generate_model), "--url", endpoint_url.removesuffix("/v1"),
            "--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer,
            "--concurrency", str(concurrency), "--request-count", str(requests),
            *(["--warmup-request-count", str(warmup)] if warmup else []),
            "--isl", str(isl), "--isl-stddev", "0", "--osl", str(cfg.max_tokens), "--osl-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--random-seed", "0", "--ui-type", "none",
            "--output-artifact-dir", str(folder)]


def run_aiperf(command: list[str], folder: Path, timeout_s: float, *, where: str = "", nice: int = 0) -> dict:
    """Run one AIPerf command that writes into ``folder`` (emptied first), in its own ``TMPDIR``
    (:func:`aiperf_tmpdir`, removed after: AIPerf leaves an empty ``aiperf_mmap_<uuid>/`` and a
    ``tmp*/aiperf/`` of ZMQ socket files there), offline (``HF_HUB_OFFLINE``). ``nice`` > 0: under
    ``nice -n <nice>`` (its worker processes inherit it).

    Returns ``{"export": <profile_export_aiperf.json>, "client_cpu": :func:`client_cpu`}``, or
    ``{"failed": why}`` when the temp folder is unusable, AIPerf exits non-zero, writes no export, or
    reports any failed request (:func:`aiperf_errors`; AIPerf 0.5 then still exits 0): such a run
    is not a measurement. ``where`` names the run in the reason (e.g. "concurrency 4").
    """
    import subprocess

    at = f" at {where}" if where else ""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        tmp = aiperf_tmpdir()
    except PipelineError as e:
        return {"failed": str(e)}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TMPDIR": str(tmp)}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    try:
        done = subprocess.run(["nice", "-n", str(nice), *command] if nice else command, capture_output=True,
                              text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"failed": f"aiperf did not finish in {timeout_s:g} s{at}"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cpu = client_cpu(before, resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start)
    export = next(iter(sorted(folder.rglob("profile_export_aiperf.json"))), None)
    if done.returncode != 0 or export is None:
        return {"failed": f"aiperf exited with status {done.returncode}{at}: {_plain_tail(done.stdout + done.stderr)}"}
    data = json.loads(export.read_text())
    if errors := aiperf_errors(data):
        return {"failed": f"aiperf{at}: {errors} (its exit status was {done.returncode})"}
    return {"export": data, "client_cpu": cpu}


#: Longest AF_UNIX socket path (``sockaddr_un.sun_path`` less its NUL), bytes.
UNIX_SOCKET_PATH_MAX = 107
#: What AIPerf 0.5 appends to ``TMPDIR`` for its longest ZMQ socket (``mkdtemp()`` + file name).
AIPERF_SOCKET_TAIL = "/tmpXXXXXXXX/aiperf/dataset_manager_proxy_frontend.ipc"


def aiperf_tmpdir() -> Path:
    """A new, empty folder for one AIPerf run's ``TMPDIR``, in the system's temp folder (the caller
    removes it). Not under the bench folder: AIPerf binds its ZMQ IPC sockets under ``TMPDIR``, and a
    path past :data:`UNIX_SOCKET_PATH_MAX` bytes makes it stop at once, yet exit 0 with no results.

    Raises:
        EnvironmentFault: even this folder is too long a path for the sockets (a long ``TMPDIR``).
    """
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="aiperf-"))
    if len(os.fsencode(str(tmp) + AIPERF_SOCKET_TAIL)) > UNIX_SOCKET_PATH_MAX:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EnvironmentFault(f"TMPDIR {tempfile.gettempdir()!r} is too long a path for AIPerf's ZMQ sockets "
                               f"(at most {UNIX_SOCKET_PATH_MAX} bytes with {AIPERF_SOCKET_TAIL!r}); set a shorter "
                               "TMPDIR, or bench --no-aiperf")
    return tmp


def aiperf_errors(export: dict) -> str | None:
    """What failed in an AIPerf ``profile_export_aiperf.json``: ``"N requests failed: <count> x <code>
    <message>; ..."`` from its ``error_request_count`` and ``error_summary``; None when no request failed."""
    count = (export.get("error_request_count") or {}).get("avg") or 0
    summary = export.get("error_summary") or []
    if not count and not summary:
        return None
    kinds = []
    for item in summary[:3]:
        e = item.get("error_details") or {}
        kinds.append(f"{item.get('count', '?')} x {e.get('code', '')} {e.get('type', '')}: "
                     f"{str(e.get('message', ''))[:300]}")
    return f"{int(count) if count else '?'} requests failed: " + ("; ".join(kinds) or "no error summary")


def _plain_tail(text: str, chars: int = 800) -> str:
    """The end of a tool's output as plain text: rich's box-drawing frames dropped, spaces collapsed."""
    plain = re.sub(r"[\u2500-\u257f]+", " ", text)
    return " ".join(plain.split())[-chars:]


def client_cpu(before, after, wall_s: float) -> dict:
    """CPU a finished child process tree used (two ``getrusage(RUSAGE_CHILDREN)`` readings around it):
    ``cpu_s`` (user + system, s), ``wall_s``, ``cores`` (cpu_s / wall_s) and ``cpus`` (this machine's)."""
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": cpu_s, "wall_s": wall_s, "cores": cpu_s / wall_s if wall_s > 0 else None, "cpus": os.cpu_count()}


def aiperf_metrics(export: dict) -> dict:
    """The :data:`AIPERF_METRICS` of an AIPerf ``profile_export_aiperf.json`` (avg, p50, p90, p99, unit)."""
    found = export.get("records", export)
    out = {}
    for name in AIPERF_METRICS:
        m = found.get(name)
        if isinstance(m, dict):
            out[name] = {k: m.get(k) for k in ("avg", "p50", "p90", "p99", "unit")}
    return out
