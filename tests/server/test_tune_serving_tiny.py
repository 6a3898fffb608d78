"""tune-serving on a real tritonserver: the tiny encoder, two candidates (1 and 2 compute instances)
loaded with load_model(config=...) and measured through the ensemble; a refused config is named
with its server-log line; the pin it writes reaches the serve copy's config.pbtxt."""
from __future__ import annotations

import json

import pytest

from pipeline.serve import tune as T
from pipeline.serve.prepare import prepare, with_triton
from pipeline.triton import pin
from pipeline.triton.config import parse_config
from pipeline.triton.server import TritonServerError
from serve_tiny import encoder_artifacts, encoder_recipe

pytestmark = pytest.mark.server

SERVE = {"concurrency": [2], "requests_per_level": 4, "cpu_cores": 2,
         "slo": {"latency_ms": 60000}, "tune": {"measure_s": 0.5, "min_requests": 4, "time_limit_s": 120, "repeats": 1}}


def test_two_candidates_on_a_real_server_and_the_pin_reaches_the_serve_copy(tmp_path):
    pytest.importorskip("pytriton")
    from pipeline.serve.run import launch

    recipe = encoder_recipe(tmp_path, serve=SERVE, target="onnxruntime")
    artifacts = encoder_artifacts(tmp_path)
    served = prepare(recipe, artifacts, backends=["python"])  # a python-onnxruntime serve copy
    full = T.space(served, cores=2, max_instances=2)
    assert full.default.as_dict()["compute"]["instance_count"] == 1
    sp = T.Space(full.default, (T.Dimension("compute", "instance_count", (1, 2)),), 2, full.profile_max_batch,
                 full.models)
    lines: list[str] = []
    with launch(served) as server:
        runner = T.Runner(served, server, sp, 2, lines.append)
        out = T.search(sp.default, sp.dimensions, runner.measure, time_limit_s=120, repeats=1, cores=2,
                       valid=sp.valid, log=lines.append)
        # a config Triton refuses: named with the server log's line, skipped, the server still up
        bad = full.default.with_value("compute", "preferred_batch_size", 64)  # over max_batch_size 8
        refused = runner.measure(bad)
        assert server.process.poll() is None
        # the open-loop operating point (serve.tune.rate): rate x measure_s requests, at least min_requests
        offered = T.Runner(served, server, sp, T.Point(rate=20.0)).measure(full.default)
        assert offered.status == T.OK and offered.requests == 10 and offered.p50_ms <= offered.p99_ms
        # a server that dies mid-search: exit 4 with the log's end, not a skipped candidate
        server.process.kill()
        server.process.wait()
        with pytest.raises(TritonServerError, match="during the search; its log's end") as died:
            runner.measure(full.default.with_value("compute", "instance_count", 2))
        assert died.value.exit_code == 4
    assert refused.status == T.REFUSED and "tiny_enc" in refused.detail
    searched = {r["candidate"] for r in out.rows}
    assert {c.get("compute", "instance_count") for c in searched} == {1, 2}
    for r in out.rows:
        m = r["measurement"]
        assert m.status == T.OK and m.requests >= 4 and m.duration_s >= 0.5 and m.feasible
        assert 0 < m.p50_ms <= m.p99_ms and m.goodput_rps == pytest.approx(m.throughput_rps)
    assert out.feasible and out.chosen in searched and len(out.rows) == 4  # 2 searched + 2 repeats

    report = T.report(out, sp, {"tritonserver": "2.51"}, served, tmp_path / "tune")
    assert (tmp_path / "tune" / T.PLOT_FILE).is_file() and "| 1 | default |" in report["markdown"]

    # the pin, measured on python-onnxruntime, goes into the serve copy only
    recipe_path = tmp_path / "tiny-encoder.yaml"
    chosen = {"tiny_enc": T.chosen_fields("compute", {**out.chosen.as_dict()["compute"], "instance_count": 2})}
    fields = pin.match_fields(recipe, pin.served_graphs(recipe, artifacts["quantize"], artifacts["build"],
                                                        "python-onnxruntime"),
                              pin.runtimes_of(recipe, "python-onnxruntime", None))
    pin.write(pin.pin_path(recipe_path, recipe.name), fields, chosen, T.candidate_rows(out), "x", {})
    pinned = prepare(recipe, artifacts, backends=["python"], recipe_path=recipe_path)
    cfg = parse_config((pinned.repository / "tiny_enc" / "config.pbtxt").read_text())
    assert cfg.instance_group[0].count == 2 and "serving pin" in pinned.note
    index = json.loads((pinned.repository / "repository.json").read_text())
    copy = with_triton(recipe, target="python-onnxruntime")  # the copy's recipe; the pin leaves its hash alone
    assert index["models"]["tiny_enc"]["recipe_hash"] == copy.digest != pinned.recipe.digest
    assert pinned.recipe.triton.instance_group[0].count == 2  # Served.recipe: the values the configs hold


def test_generation_model_candidates_on_a_real_server(tmp_path):
    """The tiny LM served by python-onnxruntime: the generation model's own settings are the space,
    and two scheduler limits are loaded and measured with streamed generations."""
    pytest.importorskip("pytriton")
    from pipeline.serve.run import launch
    from serve_tiny import llm_artifacts, llm_recipe

    serve = {"concurrency": [2], "requests_per_level": 4, "max_tokens": 4, "long_max_tokens": 20,
             "tpot_positions": [5, 15], "slo": {"ttft_ms": 60000, "tpot_ms": 60000},
             "tune": {"measure_s": 0.5, "min_requests": 4, "repeats": 1}}
    served = prepare(llm_recipe(tmp_path, serve=serve), llm_artifacts(tmp_path), backends=["python"])
    full = T.space(served, cores=2, max_instances=2)
    assert full.models == {"generate": served.generate_model}
    assert {d.name for d in full.dimensions} == {"max_concurrent_generations", "instance_count", "intra_op_threads"}
    sp = T.Space(full.default, (T.Dimension("generate", "max_concurrent_generations", (1, 4)),), 2, None, full.models)
    with launch(served) as server:
        out = T.search(sp.default, sp.dimensions, T.Runner(served, server, sp, 2).measure, time_limit_s=120,
                       repeats=1, cores=2, valid=sp.valid, log=lambda s: None)
    assert {r["candidate"].get("generate", "max_concurrent_generations") for r in out.rows} == {1, 4}
    for r in out.rows:
        m = r["measurement"]
        assert m.status == T.OK, m.detail
        assert m.requests >= 4 and m.ttft_p99_ms > 0 and m.tpot_p99_ms > 0 and m.feasible
    assert T.pin_chosen(out, sp)[served.generate_model]["role"] == "generate"
