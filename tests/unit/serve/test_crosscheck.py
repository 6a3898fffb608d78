"""The AIPerf cross-check's arithmetic and rules on fake runs and fake AIPerf exports: the interleaved
ratio and its standard error, a run with request errors is not a measurement (and exits 4), the
encoder's KServe v2 request body."""
from __future__ import annotations

import json
import math
import os
import stat
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.serve import crosscheck as X


def test_the_ratio_pairs_each_aiperf_run_with_the_mean_of_the_ours_runs_either_side():
    r = X.crosscheck_ratio([10.0, 12.0, 8.0], [11.0, 9.9])
    assert r["per_round"] == pytest.approx([1.0, 0.99])
    assert r["mean"] == pytest.approx(0.995) and r["min"] == pytest.approx(0.99) and r["max"] == pytest.approx(1.0)
    assert r["stderr"] == pytest.approx(np.std([1.0, 0.99], ddof=1) / math.sqrt(2))
    assert r["rounds"] == 2 and r["ours_median_rps"] == 10.0 and r["aiperf_median_rps"] == pytest.approx(10.45)
    assert r["within_tolerance"]


def test_a_linear_drift_of_the_machine_cancels_and_a_gap_past_10_percent_is_reported():
    ours = [10.0, 8.0, 6.0, 4.0]  # the machine slows down linearly; AIPerf measures the same server
    assert X.crosscheck_ratio(ours, [9.0, 7.0, 5.0])["per_round"] == pytest.approx([1.0, 1.0, 1.0])
    off = X.crosscheck_ratio([10.0, 10.0, 10.0], [8.5, 8.8])
    assert off["mean"] == pytest.approx(0.865) and not off["within_tolerance"]
    assert X.crosscheck_ratio([10.0, 10.0], [9.0])["stderr"] is None  # one round: no spread to give


def test_a_verdict_less_than_two_standard_errors_from_the_bound_is_within_noise():
    assert not X.within_noise(0.995, 0.005)  # 0.095 from the bound, 19 SE
    assert X.within_noise(0.945, 0.422)  # "within" by 0.045, with an SE of 0.42
    assert X.within_noise(0.85, 0.04)  # "not within" by 0.05: 1.25 SE
    assert X.within_noise(0.98, None)  # one round: no standard error
    wide = X.crosscheck_ratio([1.0, 3.0, 1.0, 3.0], [2.0, 1.0, 3.0])
    assert wide["within_noise"]
    assert "within noise" in "\n".join(X.render({"ratio": wide, "ours": [], "aiperf": [], "loadavg_1m": [1.0, 1.0]}))


@pytest.mark.parametrize("ours, theirs", [([10.0], [9.0]), ([10.0, 10.0, 10.0], [9.0]), ([10.0, 10.0], []),
                                          ([10.0, 0.0], [9.0])])
def test_runs_that_do_not_interleave_or_a_zero_throughput_are_refused(ours, theirs):
    with pytest.raises(ValueError):
        X.crosscheck_ratio(ours, theirs)


def _runs(values):
    it = iter(values)
    return lambda *a: next(it)


def test_interleave_alternates_ours_first_and_last_and_aiperf_gets_the_previous_runs_count():
    asked: list[int] = []

    def theirs(requests, before):
        asked.append(requests)
        return {"throughput_rps": before["throughput_rps"], "requests": requests}

    ours = _runs([{"throughput_rps": 3.0, "requests": 16}, {"throughput_rps": 10.0, "requests": 100},
                  {"throughput_rps": 10.0, "requests": 120}, {"throughput_rps": 10.0, "requests": 90}])
    out = X.interleave(2, ours, theirs, log=lambda s: None)
    assert asked == [100, 120] and len(out["ours"]) == 3 and len(out["aiperf"]) == 2
    assert out["settle"]["throughput_rps"] == 3.0  # the first run after the load: run, not counted
    assert out["ratio"]["mean"] == pytest.approx(1.0) and out["ratio"]["stderr"] == 0.0
    md = "\n".join(X.render({**out, "point": "concurrency 4", "loadavg_1m": [1.0, 1.0]}))
    assert "| 1 | ours (settling, not counted) | 16 | 3 |" in md and "| 3 | AIPerf | 100 | 10 |" in md


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_failed_run_stops_the_check_without_a_ratio(fail_at):
    """Ours, AIPerf, ours: whichever has request errors, nothing after it runs and no ratio is given."""
    calls = []
    ok = {"throughput_rps": 10.0, "requests": 20}

    def run(name):
        def go(*a):
            calls.append(name)
            return {"failed": "3 requests failed: 3 x 400 Bad Request"} if len(calls) == fail_at else ok
        return go

    out = X.interleave(1, run("ours"), run("aiperf"), log=lambda s: None, settle=False)
    assert "ratio" not in out and "3 requests failed" in out["failed"]
    assert len(calls) == fail_at and out["failed"].startswith(("ours run", "aiperf run"))
    assert "Cross-check failed" in "\n".join(X.render({**out, "point": "concurrency 4"}))


def test_the_kserve_template_renders_valid_json_for_any_text():
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment(autoescape=True).from_string(X.kserve_template("text"))  # as AIPerf 0.5 compiles it
    for text in ['plain', 'quotes " and \' & <b> \\ back', 'new\nline \u00e9\u4e2d']:
        body = json.loads(template.render(text=text))
        assert body == {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}


def test_the_encoder_dataset_is_the_workloads_sentences_and_other_workloads_are_named():
    text = lambda s: {"text": np.array([[s.encode()]], dtype=np.object_)}  # noqa: E731
    assert X.encoder_dataset([text("a b"), text("\u00e9")]) == ("text", ["a b", "\u00e9"])
    with pytest.raises(ValueError, match=r"inputs \[\('attention_mask', 'input_ids'\)\]"):
        X.encoder_dataset([{"input_ids": np.zeros((1, 4)), "attention_mask": np.ones((1, 4))}])
    with pytest.raises(ValueError, match="int64 \\[1, 4\\]"):
        X.encoder_dataset([{"text": np.zeros((1, 4), np.int64)}])


def test_aiperf_throughput_reads_request_throughput():
    assert X.aiperf_throughput({"request_throughput": {"unit": "requests/sec", "avg": 17.5}}) == 17.5
    with pytest.raises(ValueError, match="request_throughput"):
        X.aiperf_throughput({"request_latency": {"avg": 3.0}})


#: A stand-in ``aiperf`` CLI writing an export with FAKE_AIPERF_RPS requests/s, and FAKE_AIPERF_ERRORS
#: failed requests when set (AIPerf 0.5 exits 0 then); its nice value in ``nice.txt`` and, from an
#: ``--input-file``, the KServe bodies AIPerf's template renders in ``inputs.json``.
FAKE_AIPERF = """#!{python}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--output-artifact-dir") + 1])
out.mkdir(parents=True, exist_ok=True)
n = int(args[args.index("--request-count") + 1])
export = {{"request_throughput": {{"unit": "requests/sec", "avg": float(os.environ["FAKE_AIPERF_RPS"])}},
          "request_count": {{"unit": "requests", "avg": float(n)}},
          "request_latency": {{"unit": "ms", "avg": 50.0, "p50": 48.0, "p99": 90.0}}}}
errors = int(os.environ.get("FAKE_AIPERF_ERRORS", "0"))
if errors:
    export["error_request_count"] = {{"unit": "requests", "avg": float(errors)}}
    export["error_summary"] = [{{"error_details": {{"code": 400, "type": "Bad Request",
                                 "message": "unexpected inference input 'txt'"}}, "count": errors}}]
(out / "profile_export_aiperf.json").write_text(json.dumps(export))
(out / "nice.txt").write_text(str(os.nice(0)))
if "--input-file" in args:
    texts = [json.loads(line)["text"] for line in open(args[args.index("--input-file") + 1])]
    bodies = [{{"inputs": [{{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [t]}}]}} for t in texts]
    (out / "inputs.json").write_text(json.dumps({{"data": [{{"session_id": str(i), "payloads": [b]}}
                                                          for i, b in enumerate(bodies)]}}))
"""


@pytest.mark.parametrize("errors", [0, 2])
def test_cross_check_on_fake_aiperf_outputs_and_its_exit_code(tmp_path, monkeypatch, errors):
    """The encoder route with a fake CLI and a fake runner: the ratio from AIPerf's export; an export
    with failed requests is not a measurement, and tune-serving then exits 4 (as bench)."""
    import shutil

    from pipeline.errors import EXIT_ENVIRONMENT
    from pipeline.serve import tune as T

    exe = tmp_path / "bin" / "aiperf"
    exe.parent.mkdir()
    exe.write_text(FAKE_AIPERF.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(shutil, "which", lambda name: str(exe) if name == "aiperf" else None)
    monkeypatch.setenv("FAKE_AIPERF_RPS", "9.0")
    monkeypatch.setenv("FAKE_AIPERF_ERRORS", str(errors))
    texts = [{"text": np.array([[s.encode()]], dtype=np.object_)} for s in ("one", "two")]
    tok = tmp_path / "tok"
    tok.mkdir()
    served = SimpleNamespace(generate_model=None, ensemble_model="enc_ensemble", recipe=None,
                             artifacts={"export": SimpleNamespace(tokenizer_dir=str(tok))},
                             adapter=SimpleNamespace(bench_workload=lambda r, t: SimpleNamespace(requests=texts)))
    drives = iter([5.0, 10.0, 8.0, 10.0])  # the first: the settling run
    asked: list = []

    def drive(http_url=None, *, nice=0):
        asked.append((http_url, nice))
        runner.client_cpu_s = 0.4
        return T.Measurement(T.OK, throughput_rps=next(drives), requests=40, p50_ms=1.0, p99_ms=2.0, duration_s=4.0)

    runner = SimpleNamespace(point=T.Point(4), check_alive=lambda: None, drive=drive, client_cpu_s=0.0)
    server = SimpleNamespace(http_url="127.0.0.1:1")
    out = X.cross_check(served, server, runner, rounds=2, folder=tmp_path / "xc", log=lambda s: None)
    # ours on AIPerf's route (Triton's HTTP address, KServe v2 JSON) at the same niceness as AIPerf
    assert set(asked) == {("127.0.0.1:1", X.CLIENT_NICE)} and out["client_nice"] == X.CLIENT_NICE
    assert int((tmp_path / "xc" / "aiperf_1" / "nice.txt").read_text()) == min(os.nice(0) + X.CLIENT_NICE, 19)
    assert out["ours_route"] == out["route"] == "KServe v2 JSON, HTTP /v2/models/enc_ensemble/infer"
    assert out["ours"][0]["client_cpu"]["cpu_s"] == 0.4 and out["ours"][0]["client_cpu"]["cores"] > 0
    if errors:
        assert "failed" in out and "2 requests failed: 2 x 400 Bad Request" in out["failed"]
        assert len(out["ours"]) == 1 and out["aiperf"] == [] and "ratio" not in out and out["settle"]
        assert T.cross_check_exit(out, 0) == EXIT_ENVIRONMENT and T.cross_check_exit(out, 1) == 1
        return
    assert [a["requests"] for a in out["aiperf"]] == [40, 40]
    assert out["ratio"]["per_round"] == pytest.approx([1.0, 1.0]) and out["ratio"]["within_tolerance"]
    cmd = out["command"]
    assert cmd[cmd.index("--endpoint") + 1] == "/v2/models/enc_ensemble/infer"
    assert cmd[cmd.index("--endpoint-type") + 1] == "template" and cmd[cmd.index("--concurrency") + 1] == "4"
    assert cmd[cmd.index("--warmup-request-count") + 1] == "8"
    sent = (tmp_path / "xc" / "sentences.jsonl").read_text().splitlines()
    assert [json.loads(s)["text"] for s in sent] == ["one", "two"]
    assert out["requests_compared"] == {"bodies": 2, "differences": []}  # AIPerf's bodies are ours
    md = "\n".join(X.render(out))
    assert "both on KServe v2 JSON" in md and f"nice +{X.CLIENT_NICE}" in md and "have our fields and values" in md
    assert T.cross_check_exit(out, 0) == 0 and T.cross_check_exit(None, 0) == 0


def test_an_offered_rate_or_a_missing_cli_is_skipped_not_failed(tmp_path, monkeypatch):
    import shutil

    from pipeline.serve import tune as T

    served = SimpleNamespace(generate_model=None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr("pipeline.serve.bench.aiperf_exe", lambda: None)
    out = X.cross_check(served, None, SimpleNamespace(point=T.Point(4)), rounds=1, folder=tmp_path)
    assert "not installed" in out["skipped"]
    monkeypatch.setattr("pipeline.serve.bench.aiperf_exe", lambda: "/bin/true")
    out = X.cross_check(served, None, SimpleNamespace(point=T.Point(rate=5.0)), rounds=1, folder=tmp_path)
    assert "offered rate" in out["skipped"] and T.cross_check_exit(out, 0) == 0
