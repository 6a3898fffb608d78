"""The AIPerf cross-check on a real tritonserver, as tune-serving --cross-check runs it: the tiny
encoder's ensemble driven by our client and by AIPerf's template endpoint on /v2/models/<m>/infer,
interleaved; one AIPerf run (its start-up is most of this test's time)."""
from __future__ import annotations

import json

import pytest

from pipeline.serve import crosscheck as X
from pipeline.serve import tune as T
from pipeline.serve.prepare import prepare
from serve_tiny import encoder_artifacts, encoder_recipe

pytestmark = pytest.mark.server

SERVE = {"concurrency": [2], "requests_per_level": 4, "cpu_cores": 2,
         "slo": {"latency_ms": 60000}, "tune": {"measure_s": 0.5, "min_requests": 8, "time_limit_s": 1.0}}


def test_our_client_and_aiperfs_template_endpoint_on_the_tiny_encoder(tmp_path):
    pytest.importorskip("pytriton")
    from pipeline.serve.bench import aiperf_exe

    if aiperf_exe() is None:
        pytest.skip("no aiperf CLI")
    served = prepare(encoder_recipe(tmp_path, serve=SERVE, target="onnxruntime"), encoder_artifacts(tmp_path),
                     backends=["python"])
    lines: list[str] = []
    # tune-serving's path: a search that stops after the recipe's config (time limit), then the cross-check
    # on the chosen config before the server stops
    out, sp, env = T.run(served, log=lines.append, cores=2, cross_check_rounds=1)
    assert out.chosen == sp.default and out.cross_check is not None
    result = out.cross_check
    md = T.report(out, sp, env, served, tmp_path / "tune")["markdown"]
    assert "AIPerf / ours requests/s" in md and "| 3 | AIPerf |" in md and "settling" in md
    assert json.loads((tmp_path / "tune" / "tune.json").read_text())["cross_check"]["ratio"]["rounds"] == 1
    assert "failed" not in result and "skipped" not in result, result
    ours, theirs = result["ours"], result["aiperf"]
    assert len(ours) == 2 and len(theirs) == 1
    assert theirs[0]["requests"] == ours[0]["requests"] >= 8  # AIPerf sent as many as the ours run before it
    r = result["ratio"]
    assert r["per_round"] == [pytest.approx(theirs[0]["throughput_rps"] * 2 / (ours[0]["throughput_rps"]
                                                                             + ours[1]["throughput_rps"]))]
    assert r["rounds"] == 1 and r["stderr"] is None and r["mean"] > 0
    # AIPerf sent the workload's sentences, in order, as KServe v2 requests to the ensemble
    sent = json.loads(next((served.run_dir / "tune_serving" / "cross_check").rglob("inputs.json")).read_text())["data"]
    body = sent[0]["payloads"][0]["inputs"][0]
    assert body["name"] == "text" and body["shape"] == [1, 1] and body["datatype"] == "BYTES"
    _, texts = X.encoder_dataset(served.adapter.bench_workload(served.recipe,
                                                               served.artifacts["export"].tokenizer_dir).requests)
    assert [s["payloads"][0]["inputs"][0]["data"][0] for s in sent] == texts
    assert "/v2/models/tiny_enc_ensemble/infer" in result["route"]
    # ours took AIPerf's route with AIPerf's bodies, both clients niced alike
    assert result["ours_route"] == result["route"] and result["client_nice"] == X.CLIENT_NICE
    assert result["requests_compared"] == {"bodies": len(texts), "differences": []}
    assert ours[0]["client_cpu"]["cpu_s"] > 0
