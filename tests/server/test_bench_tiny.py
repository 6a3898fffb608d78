"""``bench`` end to end on a tiny KV-cache LM: a real server, a short bounded load; checks what
the numbers must satisfy (counts, statistics, percentile order), never how fast they are."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.serve.prepare import prepare
from serve_tiny import llm_artifacts, llm_recipe

pytestmark = pytest.mark.server

SERVE = {"concurrency": [1, 3], "requests_per_level": 6, "max_tokens": 5, "long_max_tokens": 20, "long_requests": 2,
         "tpot_positions": [5, 15], "bucket_tokens": 8, "batching_concurrency": 4, "batching_requests": 8,
         "slo": {"ttft_ms": 60000, "tpot_ms": 60000}}


def test_bench_llm_reports_percentiles_goodput_positions_and_batches(tmp_path):
    pytest.importorskip("pytriton")
    from pipeline.serve.run import bench

    recipe = llm_recipe(tmp_path, serve=SERVE, dynamic_batching={"max_queue_delay_microseconds": 50000})
    served = prepare(recipe, llm_artifacts(tmp_path), backends=["python"])
    lines: list[str] = []
    result = bench(served, log=lines.append)

    llm = result["llm"]
    assert [lv["concurrency"] for lv in llm["levels"]] == [1, 3]
    for lv in llm["levels"]:
        assert lv["requests"] == 6 and lv["slo_met"] == 1.0  # SLO of a minute: every request meets it
        assert lv["goodput_rps"] == pytest.approx(lv["requests_per_s"])
        assert lv["output_tokens_per_s"] == pytest.approx(5 * lv["requests_per_s"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert 0 < lv[key]["p50"] <= lv[key]["p90"] <= lv[key]["p99"]
        b = lv["scheduler_batches"]  # the scheduler's own steps: one prefill + 4 decode steps per request
        assert sum(int(k) * n for k, n in b["executions_by_batch_size"].items()) == 6 * 5
    pos = llm["tpot_by_position"]
    assert pos["tokens"] == 20 and len(pos["requests"]) == 2 and set(pos["tpot_ms"]) == {"5", "15"}
    assert all(len(r["gaps_ms"]) == 19 for r in pos["requests"])
    assert pos["ratio"] == pytest.approx(pos["tpot_ms"]["15"] / pos["tpot_ms"]["5"])
    assert pos["ratio_range"][0] <= pos["ratio_range"][1]
    overhead = llm["serving_overhead"]  # served TPOT vs the served graph's own step, same run
    assert overhead["graph"].endswith("tiny/1/model.onnx") and overhead["graph_step_ms"] > 0
    assert overhead["ratio"] == pytest.approx(overhead["served_tpot_ms"] / overhead["graph_step_ms"])
    assert overhead["contexts"] == [llm["prompt_tokens"] + 1, llm["prompt_tokens"] + 4]  # max_tokens 5

    batching = result["batching"]
    assert batching["bucket_shapes"] == {"input_ids": [1, 8], "attention_mask": [1, 8]}
    assert [r["variant"] for r in batching["variants"]] == ["tiny__db_off_i1", "tiny__db_off_i2",
                                                            "tiny__db_on_i1", "tiny__db_on_i2"]
    for r in batching["variants"]:
        sizes = {int(k): n for k, n in r["batches"]["executions_by_batch_size"].items()}
        assert sum(k * n for k, n in sizes.items()) == 8 == r["requests"]
        assert r["dynamic_batching"] or set(sizes) == {1}
        assert max(sizes) <= 4  # max_batch_size
    assert all(v > 0 for v in batching["ratios"].values())

    written = json.loads((served.run_dir / "bench" / "bench.json").read_text())
    from pipeline.fsutil import strict_jsonable

    assert written["llm"]["levels"] == json.loads(json.dumps(strict_jsonable(llm["levels"])))  # NaN -> null + reason
    markdown = (served.run_dir / "bench" / "bench.md").read_text()
    assert markdown == result["markdown"] and "TPOT by output position" in markdown and "Throughput ratios" in markdown
    assert "the served graph's own decode step" in markdown
    assert any(line.startswith("tiny__db_on_i2:") for line in lines)
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"trtpipe{os.getpid()}-")]
