"""Sensitivity on a tuning split and quantize.accuracy_budget, on the tiny Llama."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

from pipeline.sources.data import DataError
from pipeline.errors import GateFailed
from pipeline.models import registry
from pipeline.quant import budget, calibrate, qdq, sensitivity as S
from pipeline.recipe.schema import Gate
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from pipeline.ort_sessions import ort_session
from tiny import seed_export, tiny_recipe

EXPORT = "artifacts/tiny-llm/export"  # the module workspace's export stage
TUNING = {"type": "corpus", "name": "lee_background", "split": {"start": 200, "stop": 215}}


def _recipe(ws: Path, model: Path, export: Path | None = None, **changes) -> Path:
    """A search recipe in ``ws``; its run starts from the stage folder ``export`` when given."""
    ws.mkdir(parents=True, exist_ok=True)
    if export is not None:
        seed_export(ws, export)
    base = {"quantize.tuning": {"data": TUNING, "max_windows": 4}, "quantize.sensitivity": {"groups": "per_projection"},
            "quantize.exclude": {"nodes": []}}  # the search starts from every GEMM quantized
    return tiny_recipe(ws, model, **{**base, **changes})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model, tiny_export):
    """``(workspace, model, export artifact)``, the export being the session's (``tiny_export``)."""
    ws, model = tmp_path_factory.mktemp("budget"), tiny_model
    path = tiny_recipe(ws, model)
    seed_export(ws, tiny_export)
    exp = run_pipeline(load_recipe(path), path, quiet=True, only=["export"]).artifacts["export"]
    return ws, model, exp


@pytest.fixture(scope="module")
def runner(tiny):
    """A TrialRunner over the tiny FP8 graph with the recipe's calibration, per projection."""
    ws, model_dir, exp = tiny
    recipe = load_recipe(_recipe(ws, model_dir))
    q = recipe.quantize
    model = onnx.load(exp.onnx_path)
    targets = qdq.find_targets(model, ["MatMul", "Gemm"])
    adapter = registry.adapter(recipe.model)
    batches = adapter.calibration_feeds(exp, q.calibration.data, q.calibration)
    amax = calibrate.collect_amax(exp.onnx_path, sorted({t.act for t in targets}), batches, "max", qdq.FORMATS["fp8"])
    tuning = adapter.calibration_feeds(exp, q.tuning.data, q.calibration.model_copy(update={"samples": 4}))
    return S.TrialRunner(model, targets, S.groups(targets, "per_projection"), amax, qdq.FORMATS["fp8"], False,
                         tuning, lambda s, f: s.run(["logits"], f)[0], ort_session(exp.onnx_path))


def test_groups_per_block_and_per_projection(runner):
    per_block = S.groups(runner.targets, "per_block")
    assert sorted(per_block) == ["model.model.layers.0", "model.model.layers.1"]
    assert all(len(v) == 7 for v in per_block.values())
    assert sorted(runner.group_nodes) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
    per_gemm = S.groups(runner.targets, "per_gemm")
    assert len(per_gemm) == 14 and "model.model.layers.1.mlp.down_proj" in per_gemm
    assert all(len(v) == 1 for v in per_gemm.values())


def test_trials_reuse_the_reference_and_cache(runner):
    all_fp = runner.measure(list(runner.group_nodes))
    assert all_fp.metrics["kld_mean"] == pytest.approx(0.0, abs=1e-6)
    assert all_fp.metrics["relative_perplexity_increase"] == pytest.approx(0.0, abs=1e-6)
    assert all_fp.metrics["top1_agreement"] == 1.0
    base = runner.measure([])
    assert base.metrics["kld_mean"] > 1e-6
    ref = runner.reference()
    n = len(runner.trials)
    assert runner.measure([]) is base and len(runner.trials) == n and runner.reference() is ref


def test_switch_graph_matches_the_written_qdq_graph(runner):
    """A trial's one-session switch graph gives the logits of the graph insert_qdq writes."""
    import numpy as np
    from pipeline.quant.sensitivity import _session, _switch_feeds

    off = ["q_proj", "down_proj"]
    kept = [t for t in runner.targets if t.node not in {n for g in off for n in runner.group_nodes[g]}]
    written = qdq.insert_qdq(runner.model, kept, runner.amax, runner.fmt, runner.per_channel)
    graph, switches = S.switch_graph(runner.model, runner.targets, runner.group_nodes, runner.amax, runner.fmt,
                                     runner.per_channel)
    on = _switch_feeds(switches, {g: n for g, n in runner.group_nodes.items() if g not in off})
    assert sorted(g for g, name in switches.items() if not on[name]) == sorted(off)
    feeds = runner.feeds[0]
    want = _session(written).run(["logits"], feeds)[0]
    got = _session(graph).run(["logits"], {**feeds, **on})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(want, _session(runner.model).run(["logits"], feeds)[0], atol=1e-5)  # really quantized


def test_trial_metrics_match_a_direct_computation(runner):
    """kld_mean / relative perplexity / top-1 of a trial against scipy log-softmax of both logits."""
    import numpy as np
    from scipy.special import log_softmax

    from pipeline.quant.sensitivity import _session

    trial = runner.measure([])
    written = qdq.insert_qdq(runner.model, runner.targets, runner.amax, runner.fmt, runner.per_channel)
    sq, sr = _session(written), _session(runner.model)
    kl, d, agree, n = 0.0, 0.0, 0, 0
    for f in runner.feeds:
        lq = log_softmax(sq.run(["logits"], f)[0][:, :-1].astype(np.float64), -1)
        lr = log_softmax(sr.run(["logits"], f)[0][:, :-1].astype(np.float64), -1)
        tg = f["input_ids"][:, 1:, None]
        kl += float((np.exp(lr) * (lr - lq)).sum())
        d += float((np.take_along_axis(lr, tg, -1) - np.take_along_axis(lq, tg, -1)).sum())
        agree += int((lq.argmax(-1) == lr.argmax(-1)).sum())
        n += tg.size
    assert trial.metrics["kld_mean"] == pytest.approx(kl / n, rel=1e-4)
    assert trial.metrics["relative_perplexity_increase"] == pytest.approx(np.expm1(d / n), rel=1e-3, abs=1e-7)
    assert trial.metrics["top1_agreement"] == pytest.approx(agree / n, abs=2 / n)


def test_a_trial_on_fewer_windows_compares_the_same_tokens(runner):
    """The sensitivity pass may use the first batches only: every metric then compares
    candidate and reference on those tokens (an all-FP32 trial is exactly neutral)."""
    runner.feeds = [{k: v[:2] for k, v in runner.feeds[0].items()}, {k: v[2:] for k, v in runner.feeds[0].items()}]
    runner._ref, runner._cache = None, {}
    try:
        full, part = runner.measure([]), runner.measure([], 1)
        assert (full.windows, part.windows) == (4, 2) and part is not full
        neutral = runner.measure(list(runner.group_nodes), 1)
        assert neutral.metrics["relative_perplexity_increase"] == pytest.approx(0.0, abs=1e-6)
        assert abs(part.metrics["relative_perplexity_increase"]) < 0.5 and part.metrics["kld_mean"] > 1e-6
    finally:
        runner.feeds = [{k: np.concatenate([f[k] for f in runner.feeds]) for k in runner.feeds[0]}]
        runner._ref, runner._cache = None, {}


def test_sensitivity_ranks_and_writes_chart(runner, tmp_path):
    sens = S.measure_sensitivity(runner, "kld_mean")
    assert [r["improvement"] for r in sens.rows] == sorted((r["improvement"] for r in sens.rows), reverse=True)
    top = sens.rows[0]
    assert top["metric_value"] == pytest.approx(runner.measure([top["group"]]).metrics["kld_mean"])
    assert top["improvement"] == pytest.approx(sens.baseline - top["metric_value"])
    md, png = S.write_report(sens, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"`{top['group']}`" in md.read_text()


def test_search_meets_reachable_budget_and_steps_back(runner):
    sens = S.measure_sensitivity(runner, "kld_mean")
    bound = (sens.baseline + sens.rows[0]["metric_value"]) / 2  # needs at least the most sensitive group
    res = budget.search(runner, sens, Gate(metric="kld_mean", max=bound), total_gemms=14, min_fraction=0.0,
                        max_trials=50, time_limit_s=600)
    assert res.status == "met" and res.metrics["kld_mean"] <= bound
    assert res.excluded_groups and runner.measure(res.excluded_groups).metrics == res.metrics
    for g in res.excluded_groups:  # step back: no reverted group can be re-quantized alone
        rest = [x for x in res.excluded_groups if x != g]
        assert runner.measure(rest).metrics["kld_mean"] > bound
    assert all(any(s.endswith(g) for g in res.excluded_groups) for s in res.excluded_scopes)
    snippet = yaml.safe_load(res.snippet(["*lm_head*"]))
    assert snippet["quantize"]["exclude"]["nodes"] == ["*lm_head*", *res.excluded_scopes]
    assert res.quantized_fraction == pytest.approx(1 - len(res.excluded_scopes) / 14)


def test_search_respects_floor_and_limits(runner):
    sens = S.measure_sensitivity(runner, "kld_mean")
    res = budget.search(runner, sens, Gate(metric="kld_mean", max=0.0), total_gemms=14, min_fraction=0.8,
                        max_trials=50, time_limit_s=600)
    assert res.status == "unreachable" and res.quantized_fraction >= 0.8
    res = budget.search(runner, sens, Gate(metric="kld_mean", max=0.0), total_gemms=14, min_fraction=0.0,
                        max_trials=1, time_limit_s=600)
    assert res.status == "limit reached"


def test_pipeline_records_exclusions_of_a_reachable_budget(tiny, runner, capsys):
    ws, model_dir, _ = tiny
    sens = S.measure_sensitivity(runner, "kld_mean")
    bound = (sens.baseline + sens.rows[0]["metric_value"]) / 2
    path = _recipe(ws / "ok", model_dir, ws / EXPORT, **{"quantize.accuracy_budget": {"metric": "kld_mean", "max": bound}})
    capsys.readouterr()
    result = run_pipeline(load_recipe(path), path, quiet=False)
    assert result.passed
    q = result.artifacts["quantize"]
    found = q.calibration["accuracy_budget"]
    assert found["status"] == "met" and found["metrics"]["kld_mean"] <= bound
    kept = len(found["excluded_scopes"])
    assert (f"  accuracy budget met: {kept} GEMMs kept in high precision, kld_mean = "
            f"{found['metrics']['kld_mean']:.5g} (kld_mean <= {bound}; ") in capsys.readouterr().err
    assert sorted(q.excluded_nodes) == sorted(n for g in found["excluded_groups"] for n in runner.group_nodes[g])
    assert yaml.safe_load(found["snippet"])["quantize"]["exclude"]["nodes"] == found["excluded_scopes"]
    stage = Path(q.onnx_path).parent
    assert (stage / "sensitivity.png").is_file() and (stage / "budget.md").is_file()
    manifest = json.loads(result.manifest_path.read_text()) if hasattr(result, "manifest_path") else result.manifest
    assert manifest["artifacts"]["quantize"]["excluded_nodes"] == q.excluded_nodes


def test_unreachable_budget_exits_1_and_publishes_nothing(tiny):
    ws, model_dir, _ = tiny
    path = _recipe(ws / "bad", model_dir, ws / EXPORT, **{"quantize.accuracy_budget": {"metric": "kld_mean", "max": 0.0},
                                             "quantize.tuning.min_quantized_fraction": 0.8})
    with pytest.raises(GateFailed, match=r"kld_mean <= 0.0 not met.*best found") as e:
        run_pipeline(load_recipe(path), path, quiet=True)
    assert e.value.exit_code == 1
    repo = ws / "bad" / "model_repository"
    assert not repo.exists() or not any(repo.iterdir())
    run = ws / "bad" / "artifacts" / "tiny-llm"
    assert (run / "quantize" / "budget_best.onnx").is_file()
    assert json.loads((run / "quantize" / "budget.json").read_text())["status"] == "unreachable"
    assert json.loads((run / "manifest.json").read_text())["stages"]["quantize"]["status"] == "failed"


def test_a_search_cut_by_its_limit_exits_1_even_when_what_it_reached_meets_the_budget(tiny, runner, monkeypatch):
    ws, model_dir, _ = tiny
    monkeypatch.setattr(budget, "TOL_FLOOR", 0.0)  # exact comparisons: the bound sits 1e-6 above a trial
    monkeypatch.setattr(budget, "NOISE_FACTOR", 0.0)
    ranking = max(1, len(runner.feeds) // 2)  # as tune() ranks
    assert ranking == len(runner.feeds), "the tiny tuning split should rank on all its windows"
    sens = S.measure_sensitivity(runner, "kld_mean", ranking)
    order = [r["group"] for r in sens.rows]
    two = runner.measure(order[:2]).metrics["kld_mean"]
    assert two < runner.measure(order[:1]).metrics["kld_mean"]
    bound = two * (1 + 1e-6)  # met once the two most sensitive groups are reverted
    # the ranking pass already measured [] and each group alone on all windows, so the search's
    # only new trial before it meets the budget is order[:2]: max_trials 1 then cuts the step back
    path = _recipe(ws / "cut", model_dir, ws / EXPORT, **{"quantize.accuracy_budget": {"metric": "kld_mean", "max": bound},
                                             "quantize.tuning.max_trials": 1,
                                             "quantize.tuning.min_quantized_fraction": 0.0})
    with pytest.raises(GateFailed, match=r"stopped at tuning.max_trials .*meets kld_mean <= .*not used") as e:
        run_pipeline(load_recipe(path), path, quiet=True)
    assert e.value.exit_code == 1
    run = ws / "cut" / "artifacts" / "tiny-llm"
    found = json.loads((run / "quantize" / "budget.json").read_text())
    assert found["status"] == "limit reached" and sorted(found["excluded_groups"]) == sorted(order[:2])
    assert found["metrics"]["kld_mean"] <= bound
    pinned = yaml.safe_load((run / "quantize" / "budget_snippet.yaml").read_text())
    assert pinned["quantize"]["exclude"]["nodes"] == found["excluded_scopes"]
    repo = ws / "cut" / "model_repository"
    assert not repo.exists() or not any(repo.iterdir())


@pytest.mark.parametrize("split, other", [({"start": 150, "stop": 210}, "quantize.calibration.data"),
                                          ({"start": 210, "stop": 230}, "validate.data")])
def test_tuning_must_be_disjoint(tiny, split, other):
    ws, model_dir, _ = tiny
    path = _recipe(ws / f"dj{split['start']}", model_dir,
                   **{"quantize.tuning": {"data": {**TUNING, "split": split}}})
    with pytest.raises(DataError, match=rf"{other}.*quantize.tuning.data|quantize.tuning.data.*{other}"):
        budget.check_data(load_recipe(path))
    budget.check_data(load_recipe(_recipe(ws / "djok", model_dir)))  # the default tuning split is disjoint


def test_budget_report_says_why_each_kept_group_stays_in_high_precision():
    from pipeline.quant.budget import BudgetResult, why_lines

    trials = [{"excluded_groups": [], "windows": 8, "kld_mean": 0.038},
              {"excluded_groups": ["gate_proj"], "windows": 4, "kld_mean": 0.020},   # ranking pass: not judged
              {"excluded_groups": ["gate_proj"], "windows": 8, "kld_mean": 0.0289},
              {"excluded_groups": ["gate_proj", "down_proj"], "windows": 8, "kld_mean": 0.0218},
              {"excluded_groups": ["down_proj"], "windows": 8, "kld_mean": 0.0292}]
    res = BudgetResult("met", "kld_mean", "kld_mean <= 0.024", ["gate_proj", "down_proj"], [], 0.714,
                       {"kld_mean": 0.0218}, trials)
    assert why_lines(res) == [
        "Why these 2 group(s): with any one of them quantized again the budget is not met on the tuning split:", "",
        "- gate_proj quantized again: kld_mean = 0.0292, outside `kld_mean <= 0.024`",
        "- down_proj quantized again: kld_mean = 0.0289, outside `kld_mean <= 0.024`"]
    assert why_lines(BudgetResult("met", "kld_mean", "b", [], [], 1.0, {}, trials[:1])) == []


def test_fine_search_keeps_single_gemms_within_the_budget(runner):
    import dataclasses

    runner = dataclasses.replace(runner, group_nodes=dict(runner.group_nodes))  # the fine search adds groups
    sens = S.measure_sensitivity(runner, "kld_mean")
    bound = (sens.baseline + sens.rows[0]["metric_value"]) / 2
    gate = Gate(metric="kld_mean", max=bound)
    tol = budget.Tolerance.of(gate, S.thread_noise(runner, "kld_mean"))
    gains = budget._fine_gains(runner, sens, None)
    assert set(gains) == set(S.groups(runner.targets, "per_gemm")) and all(v >= 0 for v in gains.values())
    before = len(runner.trials)
    fine = budget.search_fine(runner, gains, gate, total_gemms=14, min_fraction=0.0, max_trials=80,
                              time_limit_s=600, tol=tol)
    assert fine.status == "met" and fine.metrics["kld_mean"] <= bound - tol.value
    assert all(len(runner.group_nodes[g]) == 1 for g in fine.excluded_groups)  # single GEMMs
    assert runner.measure(fine.excluded_groups).metrics == fine.metrics
    assert fine.quantized_fraction == pytest.approx(1 - len(fine.excluded_scopes) / 14)
    assert fine.notes and "full trials bracket" in fine.notes[0]
    assert len(runner.trials) - before <= budget.FULL_TRIALS + 1  # no per-GEMM trial pass


def test_a_graph_past_protobufs_limit_opens_with_its_initializers_beside_it(monkeypatch):
    """The sensitivity switch graph of a ~0.5 B model is over 2 GiB: its large initializers go to
    ONNX Runtime outside the proto (here the limit is lowered to make a small graph take that path)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.quant import sensitivity

    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(512, 600)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 600])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    x = {"x": np.ones((2, 512), np.float32)}
    expected = sensitivity._session(model).run(None, x)[0]
    monkeypatch.setattr(sensitivity, "PROTOBUF_LIMIT", 1000)
    kept = sensitivity._session(model)  # not consumed: the caller's graph keeps its data
    assert model.graph.initializer[0].data_location == onnx.TensorProto.DEFAULT
    np.testing.assert_array_equal(kept.run(None, x)[0], expected)
    consumed = sensitivity._session(model, consume=True)
    assert model.graph.initializer[0].data_location == onnx.TensorProto.EXTERNAL
    np.testing.assert_array_equal(consumed.run(None, x)[0], expected)


def test_search_after_smoothquant_reads_the_smoothed_graphs_data_file(tiny, monkeypatch):
    """With external data, SmoothQuant's saved graph refers to its own data file in the quantize
    folder: the search's shared weights and the Q/DQ insertion read from there, not the export's."""
    from pipeline import onnx_io

    monkeypatch.setenv(onnx_io.THRESHOLD_ENV, "0")
    ws, model_dir, _ = tiny
    path = _recipe(ws / "sq", model_dir, **{"quantize.precision": "int8", "quantize.per_channel_weights": True,
                                            "quantize.smoothquant": {"alpha": 0.8},
                                            "quantize.accuracy_budget": {"metric": "kld_mean", "max": 10.0}})
    result = run_pipeline(load_recipe(path), path, quiet=True, only=["export", "quantize"])
    q = result.artifacts["quantize"]
    stage = Path(q.onnx_path).parent
    assert (stage / "smoothed_fp32.onnx.data").is_file() and q.calibration["accuracy_budget"]["status"] == "met"
    assert onnx_io.check_loadable(Path(q.onnx_path)) is None


def test_the_outcome_line_says_when_nothing_stays_in_high_precision():
    res = budget.BudgetResult("met", "kld_mean", "kld_mean <= 0.05", [], [], 1.0, {"kld_mean": 0.0123456})
    assert res.outcome() == ("the all-quantized trial, nothing kept in high precision, kld_mean = 0.012346 "
                             "(kld_mean <= 0.05; 100.0% of GEMMs quantized)")
