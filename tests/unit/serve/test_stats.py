"""Bench arithmetic without a server: percentiles, TTFT / TPOT / goodput, Triton statistics,
the closed loop, bucketed feeds, the greedy comparison and the markdown (seconds)."""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.artifacts import TensorSpec
from pipeline.recipe.schema import ServeConfig, ServeSLO
from pipeline.serve.bench import bucket_feeds, closed_loop
from pipeline.serve.check import PromptCheck, cut_at_eos
from pipeline.serve.client import Generation, parse_statistics
from pipeline.serve.report import render
from pipeline.serve.stats import batch_summary, latency_level, llm_level, percentiles, stats_delta, tpot_at, tpot_by_position


def gen(sent: float, first: float, gap: float, n: int) -> Generation:
    """A generation sent at ``sent`` s whose first token came at ``first`` s, then one every ``gap`` s."""
    return Generation(sent=sent, tokens=list(range(n)), times=[first + k * gap for k in range(n)])


def test_percentiles_interpolate_linearly_and_skip_nan():
    values = list(range(1, 101))  # 1..100
    assert percentiles(values) == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})  # rank 1 + q/100 * 99
    assert percentiles([3.0, float("nan")]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_generation_ttft_tpot_and_gaps():
    g = gen(sent=10.0, first=10.2, gap=0.05, n=5)
    assert g.ttft_ms == pytest.approx(200.0)
    assert g.gaps_ms == pytest.approx([50.0] * 4)
    assert g.tpot_ms == pytest.approx(50.0)  # (last - first) / (tokens - 1)
    assert g.latency_ms == pytest.approx(400.0)
    assert math.isnan(gen(0.0, 0.1, 0.0, 1).tpot_ms)


def test_llm_level_goodput_counts_requests_meeting_both_bounds():
    slo = ServeSLO(ttft_ms=300, tpot_ms=60)
    gens = [gen(0, 0.1, 0.05, 9),   # TTFT 100, TPOT 50: meets both
            gen(0, 0.4, 0.05, 9),   # TTFT 400: misses TTFT
            gen(0, 0.1, 0.07, 9),   # TPOT 70: misses TPOT
            gen(0, 0.2, 0.06, 9)]   # TTFT 200, TPOT 60: meets both (bounds inclusive)
    level = llm_level(gens, duration_s=2.0, slo=slo)
    assert level["requests"] == 4 and level["slo_met"] == 0.5
    assert level["goodput_rps"] == pytest.approx(1.0) and level["requests_per_s"] == pytest.approx(2.0)
    assert level["output_tokens_per_s"] == pytest.approx(36 / 2.0)
    assert level["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert level["tpot_ms"]["p99"] == pytest.approx(np.percentile([50, 50, 70, 60], 99))
    assert level["itl_ms"]["p50"] == pytest.approx(np.median([50] * 16 + [70] * 8 + [60] * 8))


def test_latency_level_goodput():
    level = latency_level([10.0, 20.0, 30.0, 40.0], duration_s=0.5, slo_ms=25)
    assert level["inferences_per_s"] == 8.0 and level["goodput_rps"] == 4.0 and level["slo_met"] == 0.5
    assert level["latency_ms"]["p50"] == 25.0


def test_tpot_at_takes_the_median_gap_of_a_window_around_the_position():
    gaps = [float(k) for k in range(1, 40)]  # gap of position k is k ms
    assert tpot_at(gaps, 16) == np.median(range(12, 20))  # positions 12..19
    assert tpot_at(gaps, 16, half_window=1) == 15.5  # positions 15, 16
    with pytest.raises(ValueError, match="TPOT at position 38 needs tokens 0..41; the generation has 40"):
        tpot_at(gaps, 38)


def test_tpot_by_position_takes_the_median_over_requests():
    def steady(early_s: float, late_s: float) -> Generation:  # gap early_s up to token 10, then late_s
        times = np.cumsum([0.1] + [early_s] * 10 + [late_s] * 10)
        return Generation(sent=0.0, tokens=list(range(21)), times=list(times))

    gens = [steady(0.04, 0.044), steady(0.04, 0.08), steady(0.05, 0.05)]  # per request 1.1, 2.0, 1.0
    pos = tpot_by_position(gens, [5, 15])
    assert pos["tpot_ms"] == pytest.approx({"5": 40.0, "15": 50.0})  # medians over the three requests
    assert pos["ratio"] == pytest.approx(50.0 / 40.0)
    assert pos["ratio_range"] == pytest.approx([1.0, 2.0]) and pos["tokens"] == 21
    assert [r["ratio"] for r in pos["requests"]] == pytest.approx([1.1, 2.0, 1.0])
    with pytest.raises(ValueError, match="TPOT at position 19"):
        tpot_by_position(gens, [5, 19])


STATS = {"model_stats": [{
    "name": "m", "version": "1", "inference_count": "20", "execution_count": "9",
    "inference_stats": {"success": {"count": "20", "ns": "999"}, "queue": {"count": "20", "ns": "5000"},
                        "compute_infer": {"count": "20", "ns": "123456"}},
    "batch_stats": [{"batch_size": "1", "compute_infer": {"count": "6", "ns": "6000000"}},
                    {"batch_size": "4", "compute_infer": {"count": "2", "ns": "4000000"}},
                    {"batch_size": "6", "compute_infer": {"count": "1", "ns": "3000000"}}],
}]}


def test_statistics_are_parsed_per_execution():
    s = parse_statistics(STATS)
    assert s == {"inference_count": 20, "execution_count": 9, "queue_ns": 5000,
                 "compute_infer_ns": 13_000_000, "batches": {1: 6, 4: 2, 6: 1}}
    assert sum(size * n for size, n in s["batches"].items()) == s["inference_count"]
    assert parse_statistics({"model_stats": []})["batches"] == {}


def test_statistics_delta_and_batch_summary():
    before = {"inference_count": 4, "execution_count": 4, "compute_infer_ns": 1_000_000, "queue_ns": 0,
              "batches": {1: 4}}
    delta = stats_delta(before, parse_statistics(STATS))
    assert delta["batches"] == {1: 2, 4: 2, 6: 1} and delta["inference_count"] == 16
    summary = batch_summary(delta, wall_s=0.006)
    assert summary["executions_by_batch_size"] == {"1": 2, "4": 2, "6": 1}
    assert summary["mean_batch"] == pytest.approx(16 / 5)
    assert summary["busy_instances"] == pytest.approx(12_000_000 / 1e9 / 0.006)  # two executions at once


class Conn:
    opened = 0

    def __init__(self):
        Conn.opened += 1
        self.closed = False

    def close(self):
        self.closed = True


def test_closed_loop_runs_at_most_concurrency_at_once_and_keeps_order():
    running, peak, lock = [0], [0], threading.Lock()

    def work(conn, i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return i * i

    Conn.opened = 0
    results, duration = closed_loop(12, 3, Conn, work)
    assert results == [i * i for i in range(12)] and duration > 0
    assert peak[0] <= 3 and Conn.opened == 3


def test_closed_loop_raises_the_first_error_and_closes_connections():
    conns = []

    def connect():
        conns.append(Conn())
        return conns[-1]

    def work(conn, i):
        if i == 2:
            raise RuntimeError("server said no")
        return i

    with pytest.raises(RuntimeError, match="server said no"):
        closed_loop(8, 2, connect, work)
    assert all(c.closed for c in conns)
    with pytest.raises(OSError, match="refused"):
        closed_loop(4, 2, lambda: (_ for _ in ()).throw(OSError("refused")), work)


def test_bucket_feeds_make_one_shape_with_an_empty_past():
    specs = [TensorSpec("input_ids", "int64", ["batch", "sequence"]),
             TensorSpec("attention_mask", "int64", ["batch", "total_sequence"]),
             TensorSpec("past_key_values.0.key", "float32", ["batch", 3, "past_sequence", 64]),
             TensorSpec("token_type_ids", "int64", ["batch", "sequence"])]
    feeds = bucket_feeds(specs, tokens=64, vocab=100)
    assert {n: a.shape for n, a in feeds.items()} == {
        "input_ids": (1, 64), "attention_mask": (1, 64), "past_key_values.0.key": (1, 3, 0, 64),
        "token_type_ids": (1, 64)}
    assert feeds["input_ids"].dtype == np.int64 and 0 <= feeds["input_ids"].min() and feeds["input_ids"].max() < 100
    assert feeds["attention_mask"].all() and not feeds["token_type_ids"].any()
    assert feeds["past_key_values.0.key"].dtype == np.float32


def test_greedy_comparison_cuts_at_eos_and_requires_exact_tokens():
    assert cut_at_eos([5, 6, 0, 7, 0], {0}) == [5, 6, 0] and cut_at_eos([5, 6], {0}) == [5, 6]
    same = PromptCheck(0, [5, 6, 0], [5, 6, 0])
    assert same.ok and same.first_difference is None and "equal to the validate stage's 3" in same.verdict
    stale = PromptCheck(1, [5, 7, 8], [5, 6, 9], reference=[5, 7, 8])
    assert not stale.ok and stale.first_difference == 1
    assert "equal to a fresh batch-1 greedy run" in stale.verdict
    wrong = PromptCheck(2, [5, 7], [5, 6], reference=[5, 6])
    assert not wrong.ok and wrong.verdict.startswith("MISMATCH from position 1")
    assert PromptCheck(3, [5], [5, 6]).first_difference == 1


def test_report_renders_llm_and_batching_tables():
    level = {"concurrency": 1, **llm_level([gen(0, 0.1, 0.05, 4)], 1.0, ServeSLO()),
             "compute_batches": {"executions_by_batch_size": {"1": 4}, "executions": 4, "mean_batch": 1.0}}
    row = {"variant": "m__db_on_i2", "dynamic_batching": True, "instances": 2, "inferences_per_s": 9.5,
           "latency_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0},
           "batches": {"executions_by_batch_size": {"1": 2, "4": 3}, "mean_batch": 2.8, "busy_instances": 1.7}}
    result = {
        "recipe": "r", "serve": ServeConfig().model_dump(mode="json"),
        "environment": {"tritonserver": "2.51.0", "cpus": 2, "loadavg_1m": 0.5},
        "served": {"target": "python-onnxruntime", "note": "serving x"},
        "llm": {"prompt_tokens": 16, "levels": [level],
                "tpot_by_position": {"tokens": 260, "tpot_ms": {"16": 40.0, "256": 44.0}, "ratio": 1.1}},
        "batching": {"bucket_shapes": {"input_ids": [1, 64]}, "requests": 32, "concurrency": 8, "max_batch_size": 8,
                     "variants": [row], "ratios": {"dynamic_batching_on_over_off_1_instance": 1.5}},
    }
    text = render(result)
    assert "| 1 | 100.0 | 100.0 | 100.0 | 50.0 | 50.0 | 50.0 | 50.0 | 4.0 | 1.00 | 1.00 | 100% |" in text
    assert "ratio 256/16 = **1.10**" in text and "Shapes bucketed to one length" in text
    assert "| m__db_on_i2 | on | 2 | 9.50 | 1.0 | 2.0 | 3.0 | 1: 2, 4: 3 | 2.80 | 1.70 |" in text
    assert "dynamic batching on over off 1 instance = **1.50x**" in text
    skipped = render({**result, "batching": {"skipped": "max_batch_size is 0"}})
    assert "Not measured: max_batch_size is 0." in skipped
    assert "| 1 | 1: 4 | 1.00 |" in text  # the compute model's executions (BLS targets)


def test_report_renders_the_serving_overhead_and_an_in_process_compute_model():
    level = {"concurrency": 1, **llm_level([gen(0, 0.1, 0.05, 4)], 1.0, ServeSLO()),
             "compute_batches": {"executions_by_batch_size": {}, "executions": 0, "mean_batch": float("nan")}}
    llm = {"prompt_tokens": 16, "levels": [level],
           "tpot_by_position": {"tokens": 260, "tpot_ms": {"16": 40.0, "256": 44.0}, "ratio": 1.1},
           "serving_overhead": {"served_tpot_ms": 21.0, "graph_step_ms": 20.0, "ratio": 1.05, "contexts": [17, 47]}}
    result = {"recipe": "r", "serve": ServeConfig().model_dump(mode="json"),
              "environment": {"tritonserver": "2.51.0", "cpus": 2, "loadavg_1m": 0.5},
              "served": {"target": "python-onnxruntime", "note": "serving x"}, "llm": llm,
              "batching": {"skipped": "not here"}}
    text = render(result)
    assert ("Served batch-1 TPOT 21.0 ms (median of a request before and after) vs the served graph's own decode "
            "step 20.0 ms (ONNX Runtime alone, batch 1, contexts 17-47, same run): ratio **1.05**.") in text
    assert "count no executions during the sweep" in text and "| concurrency | executions by batch size" not in text
    skipped = render({**result, "llm": {**llm, "serving_overhead": {"skipped": "target 'tensorrt': ..."}}})
    assert "Served TPOT vs the graph's own decode step: not measured (target 'tensorrt': ...)." in skipped


def test_aiperf_loads_a_served_tokenizer_folder_offline(tmp_path, monkeypatch):
    """AIPerf 0.5's tokenizer loader, offline, on a generation model's folder (tokenizer files beside
    the Triton model.py, no config.json): the path ``bench`` and the README give ``--tokenizer``."""
    pytest.importorskip("aiperf")
    from aiperf.common.tokenizer import Tokenizer

    from serve_tiny import tiny_metaspace

    folder = tiny_metaspace(tmp_path / "smollm2_generate" / "1")
    (folder / "model.py").write_text("raise SystemExit('not a tokenizer')\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = Tokenizer.from_pretrained(str(folder))
    assert tok.encode("the cat") == [2, 4, 3] and tok.eos_token_id == 0


#: A stand-in ``aiperf`` CLI: records its argv and TMPDIR, leaves an empty aiperf_mmap_ folder in
#: TMPDIR as AIPerf 0.5 does, and writes an export with FAKE_AIPERF_ERRORS failed requests.
FAKE_AIPERF = """#!{python}
import json, os, sys, tempfile
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--output-artifact-dir") + 1])
out.mkdir(parents=True, exist_ok=True)
(Path(tempfile.gettempdir()) / "aiperf_mmap_0123").mkdir(exist_ok=True)
with open(os.environ["FAKE_AIPERF_LOG"], "a") as f:
    f.write(json.dumps({{"args": args, "tmpdir": tempfile.gettempdir()}}) + "\\n")
errors = int(os.environ.get("FAKE_AIPERF_ERRORS", "0"))
export = {{"time_to_first_token": {{"avg": 5.0, "p50": 5.0, "p90": 6.0, "p99": 7.0, "unit": "ms"}}}}
if errors:
    export["error_request_count"] = {{"unit": "requests", "avg": float(errors)}}
    export["error_summary"] = [{{"error_details": {{"code": 400, "type": "Bad Request",
                                 "message": "messages.0.name: Input should be None"}}, "count": errors}}]
(out / "profile_export_aiperf.json").write_text(json.dumps(export))
"""


def _fake_aiperf_bench(tmp_path, monkeypatch, errors: int):
    import json
    import shutil
    import stat
    import sys
    from types import SimpleNamespace

    from pipeline.serve.bench import bench_aiperf

    exe = tmp_path / "bin" / "aiperf"
    exe.parent.mkdir()
    exe.write_text(FAKE_AIPERF.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(shutil, "which", lambda name: str(exe) if name == "aiperf" else None)
    system_tmp = tmp_path / "system_tmp"  # the TMPDIR aiperf would otherwise inherit (this process's own
    # temp folder is read once, so the bench's folders are still made in the real one)
    system_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(system_tmp))
    monkeypatch.setenv("FAKE_AIPERF_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_AIPERF_ERRORS", str(errors))
    model = tmp_path / "repo" / "gen" / "1"
    model.mkdir(parents=True)
    (model / "tokenizer.json").write_text("{}")
    served = SimpleNamespace(recipe=SimpleNamespace(serve=ServeConfig(concurrency=[1, 4], requests_per_level=4)),
                             repository=tmp_path / "repo", generate_model="gen",
                             artifacts={"validate": SimpleNamespace(greedy_tokens={"prompt_ids": [[1, 2, 3]]})})
    out = tmp_path / "bench" / "aiperf"
    result = bench_aiperf(served, "http://127.0.0.1:1/v1", out, log=lambda line: None)
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    return result, calls, out, model, system_tmp


def test_bench_gives_aiperf_the_served_tokenizer_folder_and_its_own_tmpdir(tmp_path, monkeypatch):
    result, calls, out, model, system_tmp = _fake_aiperf_bench(tmp_path, monkeypatch, errors=0)
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4] and "failed" not in result
    from pipeline.serve.bench import AIPERF_SOCKET_TAIL, UNIX_SOCKET_PATH_MAX

    for call, c in zip(calls, (1, 4)):
        args = call["args"]
        assert args[args.index("--tokenizer") + 1] == str(model.resolve())  # a folder: loads offline
        assert args[args.index("--concurrency") + 1] == str(c) and args[args.index("--request-count") + 1] == "4"
        tmp = call["tmpdir"]  # its own, short enough for its ZMQ sockets, removed after the run
        assert tmp != str(system_tmp) and not Path(tmp).exists()
        assert len(tmp + AIPERF_SOCKET_TAIL) <= UNIX_SOCKET_PATH_MAX
    assert calls[0]["tmpdir"] != calls[1]["tmpdir"]
    assert list(system_tmp.iterdir()) == []  # no aiperf_mmap_<uuid>/ left in the inherited temp folder
    assert (out / "c1" / "profile_export_aiperf.json").is_file()


def test_a_temp_folder_too_long_for_aiperfs_sockets_is_refused(tmp_path, monkeypatch):
    """AIPerf under a TMPDIR past the AF_UNIX path limit stops at once and exits 0 with no results."""
    import tempfile

    from pipeline.errors import PipelineError
    from pipeline.serve.bench import aiperf_tmpdir

    deep = tmp_path / ("x" * 60) / ("y" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(PipelineError, match=r"too long a path for AIPerf's ZMQ sockets .*--no-aiperf"):
        aiperf_tmpdir()
    assert list(deep.iterdir()) == []


def test_an_aiperf_run_with_failed_requests_is_a_failure(tmp_path, monkeypatch):
    """AIPerf 0.5 exits 0 when every request failed (its error summary says why): bench fails it."""
    result, calls, *_ = _fake_aiperf_bench(tmp_path, monkeypatch, errors=4)
    assert len(calls) == 1 and result["levels"] == []  # stopped at the first level
    assert result["failed"].startswith("aiperf at concurrency 1: 4 requests failed: 4 x 400 Bad Request: "
                                       "messages.0.name: Input should be None")


def test_a_model_without_a_tokenizer_is_bucketed_without_a_vocabulary(tmp_path):
    """The generic kind (examples/custom-model) has no tokenizer.json: bench used to open one."""
    from types import SimpleNamespace

    from pipeline.serve.bench import vocab_size

    for folder in (None, "", str(tmp_path)):
        served = SimpleNamespace(artifacts={"export": SimpleNamespace(tokenizer_dir=folder)})
        assert vocab_size(served) is None
    specs = [TensorSpec("byte_ids", "int64", ["batch", "length"]), TensorSpec("input_ids", "int64", ["batch", "s"])]
    feeds = bucket_feeds(specs, 4, None)
    assert {k: v.tolist() for k, v in feeds.items()} == {"byte_ids": [[0, 0, 0, 0]], "input_ids": [[0, 0, 0, 0]]}


def test_fewer_requests_than_the_largest_concurrency_is_refused_naming_the_field():
    """AIPerf 0.5 refuses --concurrency above --request-count (and a closed loop of c threads over
    fewer than c requests never reaches c): the schema refuses it, the defaults satisfy it."""
    from pydantic import ValidationError

    assert ServeConfig().requests_per_level >= max(ServeConfig().concurrency)
    with pytest.raises(ValidationError, match=r"requests_per_level \(8\) is below the largest concurrency \(16\)"):
        ServeConfig.model_validate({"concurrency": [1, 16], "requests_per_level": 8})
    assert ServeConfig.model_validate({"concurrency": [1, 16], "requests_per_level": 16}).requests_per_level == 16


@pytest.mark.parametrize("name", ["fp8-llm", "int8-llm", "int8-encoder", "fp8-encoder", "int8-textline-orientation"])
def test_shipped_recipes_bench_as_shipped(name):
    """``make bench RECIPE=<name>`` with no ``--set``: every level has at least its concurrency's requests."""
    from conftest import ROOT
    from pipeline.recipe.load import load_recipe

    serve = load_recipe(ROOT / "recipes" / f"{name}.yaml").serve
    assert serve.requests_per_level >= max(serve.concurrency)
