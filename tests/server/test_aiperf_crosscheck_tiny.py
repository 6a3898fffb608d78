"""The AIPerf cross-check on a real tritonserver: the tiny encoder's ensemble driven by our client and
by AIPerf's template endpoint on /v2/models/<m>/infer, interleaved; one AIPerf run (its start-up is
most of this test's time)."""
from __future__ import annotations

import json

import pytest

from pipeline.serve import crosscheck as X
from pipeline.serve import tune as T
from pipeline.serve.prepare import prepare
from serve_tiny import encoder_artifacts, encoder_recipe

pytestmark = pytest.mark.server

SERVE = {"concurrency": [2], "requests_per_level": 4, "cpu_cores": 2,
         "slo": {"latency_ms": 60000}, "tune": {"measure_s": 0.5, "min_requests": 8}}


def test_our_client_and_aiperfs_template_endpoint_on_the_tiny_encoder(tmp_path):
    pytest.importorskip("pytriton")
    from pipeline.serve.bench import aiperf_exe

    if aiperf_exe() is None:
        pytest.skip("no aiperf CLI")
    from pipeline.serve.run import launch

    served = prepare(encoder_recipe(tmp_path, serve=SERVE, target="onnxruntime"), encoder_artifacts(tmp_path),
                     backends=["python"])
    sp = T.space(served, cores=2, max_instances=2)
    lines: list[str] = []
    with launch(served) as server:
        runner = T.Runner(served, server, sp, T.operating_point(served.recipe), lines.append)
        result = X.cross_check(served, server, runner, rounds=1, folder=tmp_path / "xc", log=lines.append)
    assert "failed" not in result and "skipped" not in result, result
    ours, theirs = result["ours"], result["aiperf"]
    assert len(ours) == 2 and len(theirs) == 1
    assert theirs[0]["requests"] == ours[0]["requests"] >= 8  # AIPerf sent as many as the ours run before it
    r = result["ratio"]
    assert r["per_round"] == [pytest.approx(theirs[0]["throughput_rps"] * 2 / (ours[0]["throughput_rps"]
                                                                             + ours[1]["throughput_rps"]))]
    assert r["rounds"] == 1 and r["stderr"] is None and r["mean"] > 0
    # AIPerf sent the workload's sentences, in order, as KServe v2 requests to the ensemble
    sent = json.loads(next((tmp_path / "xc").rglob("inputs.json")).read_text())["data"]
    body = sent[0]["payloads"][0]["inputs"][0]
    assert body["name"] == "text" and body["shape"] == [1, 1] and body["datatype"] == "BYTES"
    _, texts = X.encoder_dataset(served.adapter.bench_workload(served.recipe,
                                                               served.artifacts["export"].tokenizer_dir).requests)
    assert [s["payloads"][0]["inputs"][0]["data"][0] for s in sent] == texts
    assert "/v2/models/tiny_enc_ensemble/infer" in result["route"]
    md = "\n".join(X.render(result))
    assert "AIPerf / ours requests/s" in md and "| 3 | AIPerf |" in md and "settling" in md
