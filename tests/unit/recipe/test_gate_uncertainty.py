"""Gates that know their uncertainty and a report a person reads (§7):
bootstrap standard errors over eval windows / items, margins in standard errors, the
within-noise flag, statistical gate tests, and report.md / junit.xml rows."""
from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from conftest import ROOT
from pipeline.recipe import gates
from pipeline.run import report as M
from pipeline.artifacts import GateResult, to_jsonable
from pipeline.errors import RecipeError
from pipeline.metrics import uncertainty
from pipeline.metrics.llm_quality import QualityAccumulator
from pipeline.models.sentence_embedding import metrics as se_metrics
from pipeline.recipe.schema import Gate
from pipeline.recipe.load import load_recipe


# --- the bootstrap ------------------------------------------------------------------------------

def test_bootstrap_se_of_a_mean_matches_the_analytic_one_and_is_deterministic():
    rng = np.random.default_rng(3)
    means = rng.normal(0.01, 0.05, size=200)  # per-window means, 256 tokens each
    tokens = np.full(200, 256.0)
    analytic = means.std(ddof=1) / math.sqrt(len(means))
    se = uncertainty.ratio_of_sums_stderr(means * tokens, tokens)
    assert se == pytest.approx(analytic, rel=0.10)
    assert se == uncertainty.ratio_of_sums_stderr(means * tokens, tokens)  # fixed seed: same bits
    counts = uncertainty.resample_counts(200)
    assert counts.shape == (uncertainty.RESAMPLES, 200) and (counts.sum(1) == 200).all()
    with pytest.raises(ValueError, match="at least 2 eval units, got 1"):
        uncertainty.resample_counts(1)


def test_the_accumulator_resamples_windows_not_tokens():
    """Tokens of a window share an offset (correlated): the window bootstrap sees the
    window-level spread, which the token-independent formula understates."""
    rng = np.random.default_rng(0)
    vocab, seq, n_windows = 7, 33, 40
    ref = rng.normal(size=(n_windows, seq, vocab)).astype(np.float32)
    cand = ref + rng.normal(0, 0.05, size=ref.shape).astype(np.float32)
    ids = rng.integers(0, vocab, size=(n_windows, seq))
    # per-window shift of the candidate's correct-token logit: d is correlated within a window
    shift = rng.normal(0, 0.5, size=n_windows)
    np.put_along_axis(cand[:, :-1], ids[:, 1:, None],
                      np.take_along_axis(cand[:, :-1], ids[:, 1:, None], -1) - shift[:, None, None], -1)
    acc = QualityAccumulator()
    acc.add(ref, cand.astype(np.float32), ids)
    got = acc.summary()
    d = acc.values("nll_cand") - acc.values("nll_ref")
    window_means = d.reshape(n_windows, seq - 1).mean(1)
    analytic = got["perplexity_ratio"] * window_means.std(ddof=1) / math.sqrt(n_windows)  # delta method
    assert got["perplexity_ratio_stderr"] == pytest.approx(analytic, rel=0.15)
    token_iid = got["perplexity_ratio"] * d.std() / math.sqrt(len(d) - 1)
    assert got["perplexity_ratio_stderr"] > 2 * token_iid
    assert acc.basis()["perplexity_ratio"] == {
        "n": n_windows * (seq - 1), "unit": "tokens",
        "method": "paired bootstrap over 40 eval windows, 2000 resamples (seed 0)"}


def test_one_window_has_no_standard_error():
    acc = QualityAccumulator()
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(1, 6, 5)).astype(np.float32)
    acc.add(ref, ref + 0.1, rng.integers(0, 5, size=(1, 6)))
    got = acc.summary()
    assert got["perplexity_ratio_stderr"] is None and got["kld_mean_stderr"] is None and acc.basis() == {}


def test_spearman_drop_stderr_is_a_paired_bootstrap_over_pairs():
    rng = np.random.default_rng(2)
    human = {n: rng.uniform(0, 10, size=k) for n, k in (("wordsim353", 120), ("simlex999", 150))}
    ref = {**{f"cosines_{n}": h / 10 + rng.normal(0, 0.2, h.size) for n, h in human.items()}, "human_scores": human}
    cand = {**{k: v + rng.normal(0, 0.05, v.size) for k, v in ref.items() if k.startswith("cosines_")},
            "sentence_cosines": rng.uniform(0.98, 1.0, size=50)}
    got = se_metrics.drop_stderrs(ref, cand)
    assert 0 < got["spearman_drop_wordsim353_stderr"] < 5 and 0 < got["spearman_drop_simlex999_stderr"] < 5
    assert got["spearman_drop_max_stderr"] > 0
    assert got == se_metrics.drop_stderrs(ref, cand)  # deterministic
    same = se_metrics.drop_stderrs(ref, {**{k: v for k, v in ref.items() if k.startswith("cosines_")},
                                         "sentence_cosines": np.ones(5)})
    # identical models: every resample's drop is exactly 0 (the pairing cancels all sampling noise)
    assert same["spearman_drop_wordsim353_stderr"] == 0.0 and same["mean_cosine_stderr"] == 0.0
    assert se_metrics.stderr_basis(ref, 50)["spearman_drop_simlex999"]["n"] == 150
    # the vectorised rank correlation is scipy's Spearman rho (ties in the human scores included)
    from scipy.stats import spearmanr

    h = np.round(human["wordsim353"])  # ties
    c = ref["cosines_wordsim353"]
    rows = se_metrics._rowwise_spearman(np.stack([c, c[::-1]]), se_metrics._rank_rows(np.stack([h, h[::-1]])))
    assert rows == pytest.approx([spearmanr(c, h).statistic] * 2, rel=1e-12)


# --- margins, within noise, n needed --------------------------------------------------------------

def _metrics(value, se, metric="relative_perplexity_increase", n=6120):
    return {metric: value, f"{metric}_stderr": se,
            "stderr_basis": {metric: {"n": n, "unit": "tokens", "method": "paired bootstrap over 24 eval windows"}}}


def test_margin_and_within_noise_for_a_max_bound():
    [res] = gates.evaluate([Gate(metric="relative_perplexity_increase", max=0.01)], _metrics(0.0092, 0.0032))
    assert res.passed and res.stderr == 0.0032 and res.margin_se == pytest.approx((0.01 - 0.0092) / 0.0032)
    assert res.within_noise and (res.n, res.n_unit) == (6120, "tokens")
    assert res.n_needed == math.ceil(6120 * (2 * 0.0032 / 0.0008) ** 2) == 391680
    assert res.message == ("max_relative_perplexity_increase passed: relative_perplexity_increase = 0.0092 ± 0.0032 "
                           "(+0.92 % ± 0.32 %; bound <= 0.01; margin +0.25 SE); within noise (|margin| < 2 SE): ~391,680 eval tokens "
                           "(now 6,120) would resolve it")
    [far] = gates.evaluate([Gate(metric="relative_perplexity_increase", max=0.01)], _metrics(0.002, 0.0032))
    assert far.margin_se == pytest.approx(2.5) and not far.within_noise and far.n_needed is None
    [bad] = gates.evaluate([Gate(metric="relative_perplexity_increase", max=0.01)], _metrics(0.0114, 0.0032))
    assert not bad.passed and bad.margin_se == pytest.approx(-0.4375) and bad.within_noise


def test_margin_and_within_noise_for_a_min_bound():
    [res] = gates.evaluate([Gate(metric="top1_agreement", min=0.9)], _metrics(0.93, 0.01, "top1_agreement"))
    assert res.passed and res.margin_se == pytest.approx(3.0) and not res.within_noise
    [low] = gates.evaluate([Gate(metric="top1_agreement", min=0.9)], _metrics(0.89, 0.01, "top1_agreement"))
    assert not low.passed and low.margin_se == pytest.approx(-1.0) and low.within_noise
    assert low.n_needed == math.ceil(6120 * (2 * 0.01 / 0.01) ** 2)


def test_n_needed_follows_the_inverse_square_root_law():
    assert gates.n_needed(1000, 0.01, 0.01) == 4000  # gap = 1 SE: 4x the data halves the SE -> 2 SE
    assert gates.n_needed(1000, 0.01, -0.02) == 1000  # already 2 SE away
    assert gates.n_needed(1000, 0.01, 0.0) is None
    assert gates.margin_se(0.5, 0.5, True, 0.0) == 0.0 and gates.margin_se(0.4, 0.5, True, 0.0) == math.inf


def test_a_metric_without_stderr_reports_as_before():
    [res] = gates.evaluate([Gate(metric="mean_cosine", min=0.99)], {"mean_cosine": 0.995})
    assert (res.stderr, res.margin_se, res.within_noise, res.n_needed) == (None, None, None, None)
    assert res.message == "min_mean_cosine passed: mean_cosine = 0.995 (bound >= 0.99)"


# --- statistical tests ----------------------------------------------------------------------------

Z95 = 1.6448536269514722


@pytest.mark.parametrize("value, statistic, passed", [
    (0.009, "point", True), (0.011, "point", False),
    # fail only on evidence of a regression: threshold 0.01 + z*0.002 = 0.01329
    (0.011, "evidence_of_regression", True), (0.0135, "evidence_of_regression", False),
    # pass only on evidence of meeting the bound: threshold 0.01 - z*0.002 = 0.00671
    (0.009, "evidence_of_meeting", False), (0.006, "evidence_of_meeting", True),
])
def test_statistical_tests_on_a_max_bound_err_their_way(value, statistic, passed):
    gate = Gate(metric="relative_perplexity_increase", max=0.01, statistic=statistic)
    [res] = gates.evaluate([gate], _metrics(value, 0.002))
    assert res.passed is passed and res.bound == 0.01
    shift = {"point": 0.0, "evidence_of_regression": Z95 * 0.002, "evidence_of_meeting": -Z95 * 0.002}[statistic]
    assert res.threshold == pytest.approx(0.01 + shift, rel=1e-12)


@pytest.mark.parametrize("value, statistic, passed", [
    (0.895, "evidence_of_regression", True), (0.89, "evidence_of_regression", False),  # threshold 0.9 - 0.00822
    (0.905, "evidence_of_meeting", False), (0.91, "evidence_of_meeting", True),  # threshold 0.9 + 0.00822
])
def test_statistical_tests_on_a_min_bound_err_their_way(value, statistic, passed):
    gate = Gate(metric="top1_agreement", min=0.9, statistic=statistic)
    [res] = gates.evaluate([gate], _metrics(value, 0.005, "top1_agreement"))
    assert res.passed is passed
    assert "at 95%: threshold" in res.message and res.confidence == 0.95


def test_a_higher_confidence_moves_the_threshold_further():
    gate = Gate(metric="relative_perplexity_increase", max=0.01, statistic="evidence_of_regression", confidence=0.99)
    [res] = gates.evaluate([gate], _metrics(0.0135, 0.002))
    assert res.passed and res.threshold == pytest.approx(0.01 + 2.3263478740408408 * 0.002)


def test_a_statistical_test_on_a_metric_without_stderr_is_refused():
    gate = Gate(metric="min_cosine", min=0.9, statistic="evidence_of_regression")
    [(loc, msg)] = gates.problems([gate], "sentence-embedding", ("validate", "gates"))
    assert loc == ("validate", "gates", 0, "statistic")
    assert msg == ("evidence_of_regression needs a standard error, and 'min_cosine' has none; use statistic: point, "
                   "or a metric with one: ['mean_cosine', 'spearman_drop_max', 'spearman_drop_simlex999', "
                   "'spearman_drop_wordsim353']")
    assert gates.problems([Gate(metric="top1_accuracy_fp32", min=0.9, statistic="evidence_of_meeting")],
                          "image-classification", ("validate", "gates"))
    assert not gates.problems([Gate(metric=m, min=0.9, statistic="evidence_of_meeting") for m in
                               ("mean_cosine", "top1_agreement")], "generic", ("validate", "gates"))  # bootstrapped
    assert not gates.problems([Gate(metric="top1_agreement", min=0.9, statistic="evidence_of_meeting")],
                              "image-classification", ("validate", "gates"))
    # measured without one (a single eval window): refused, not silently a point comparison
    tested = Gate(metric="relative_perplexity_increase", max=0.01, statistic="evidence_of_meeting")
    with pytest.raises(RecipeError, match="asks for statistic evidence_of_meeting, but relative_perplexity_increase "
                                          "has no standard error here"):
        gates.evaluate([tested], {"relative_perplexity_increase": 0.005, "relative_perplexity_increase_stderr": None})
    # a broken model (no value) still just fails
    [broken] = gates.evaluate([tested], {"relative_perplexity_increase": None})
    assert not broken.passed


def test_the_recipe_check_refuses_a_test_without_stderr_and_stray_confidence(tmp_path):
    data = yaml.safe_load((ROOT / "recipes" / "int8-encoder.yaml").read_text())
    data["validate"]["gates"] = [{"metric": "min_cosine", "min": 0.9, "statistic": "evidence_of_meeting"}]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(RecipeError, match="validate.gates.0.statistic: evidence_of_meeting needs a standard error"):
        load_recipe(path)
    with pytest.raises(ValidationError, match="confidence applies to a statistical test only"):
        Gate(metric="kld_mean", max=0.1, confidence=0.9)
    llm = yaml.safe_load((ROOT / "recipes" / "fp8-llm.yaml").read_text())
    llm["quantize"]["accuracy_budget"]["statistic"] = "evidence_of_regression"
    path.write_text(yaml.safe_dump(llm, sort_keys=False))
    with pytest.raises(RecipeError, match="the budget search compares point values"):
        load_recipe(path)


def test_a_point_gate_dumps_as_before():
    """Recipe digests (and stage keys) of recipes without a test do not change."""
    assert Gate(metric="kld_mean", max=0.1).model_dump() == {"metric": "kld_mean", "max": 0.1, "min": None,
                                                              "name": None}
    tested = Gate(metric="kld_mean", max=0.1, statistic="evidence_of_meeting").model_dump()
    assert Gate.model_validate(tested).statistic == "evidence_of_meeting" and tested["confidence"] == 0.95


# --- report.md and junit.xml ----------------------------------------------------------------------

def _manifest(gate_results: list[GateResult], sections: dict | None = None) -> dict:
    return {"recipe": {"name": "r"}, "verdict": "fail", "versions": {"torch": "x"},
            "stages": {"export": M.stage_record("ok", "", 1.0, 10.0), "validate": M.stage_record("ok", "", 2.0, 20.0)},
            "metrics": {"relative_perplexity_increase": 0.0114, "eval_tokens": 6120},
            "gates": [{**to_jsonable(g), "message": g.message} for g in gate_results],
            "sections": sections or {}}


def _results():
    ppl = gates.evaluate([Gate(metric="relative_perplexity_increase", max=0.01)], _metrics(0.0114, 0.0032))
    cos = gates.evaluate([Gate(metric="mean_cosine", min=0.99)], {"mean_cosine": 0.995})
    return ppl + cos


def test_report_opens_with_the_verdict_the_gate_table_and_the_stages(tmp_path):
    man = _manifest(_results(), {"Accuracy budget": {"markdown": "trial table", "file": "quantize/budget.md"}})
    M.write_outputs(man, tmp_path)
    report = (tmp_path / "report.md").read_text()
    heads = [line for line in report.splitlines() if line.startswith("#")]
    assert heads == ["# r: FAIL", "## Gates", "## Stages", "## Metrics", "## Accuracy budget", "## Versions"]
    assert ("| max_relative_perplexity_increase | relative_perplexity_increase | 0.0114 ± 0.0032 | <= 0.01 | -0.44 | "
            "**FAIL**, within noise: ~127,896 eval tokens would resolve it |") in report
    assert "| min_mean_cosine | mean_cosine | 0.995 | >= 0.99 | - | pass |" in report
    assert "not gated here" not in report  # no generation metric
    gen = {"token_agreement": 0.38, "prompts_identical": 0}
    assert M.generation_note(gen, [])[1].startswith("prompts_identical, token_agreement: greedy generation")
    assert M.generation_note(gen, [{"metric": "token_agreement"}]) == []
    far = gates.evaluate([Gate(metric="relative_perplexity_increase", max=0.02)], _metrics(0.0092, 0.0032))
    assert "| 0.0092 ± 0.0032 | <= 0.02 | +3.38 | pass, clear of noise |" in M.report_markdown(_manifest(far))
    assert ("- standard error of relative_perplexity_increase: paired bootstrap over 24 eval windows, over 6120 eval "
            "tokens") in report
    junit = (tmp_path / "junit.xml").read_text()
    for prop in ('name="value" value="0.0114"', 'name="stderr" value="0.0032"', 'name="bound" value="0.01"',
                 'name="margin_se" value="-0.4375', 'name="within_noise" value="True"', 'name="n_needed" value="127896"'):
        assert prop in junit
    assert "<failure message=\"max_relative_perplexity_increase FAILED: relative_perplexity_increase = 0.0114 ± 0.0032 " \
           "(+1.14 % ± 0.32 %; bound &lt;= 0.01; margin -0.44 SE); within noise" in junit
    assert "<system-out>min_mean_cosine passed: mean_cosine = 0.995 (bound &gt;= 0.99)</system-out>" in junit
    # CI reads the same fields from manifest.json
    import json
    [g, _] = json.loads((tmp_path / "manifest.json").read_text())["gates"]
    assert (g["stderr"], g["within_noise"], g["n"], g["n_needed"]) == (0.0032, True, 6120, 127896)


def test_a_huge_section_is_capped_with_a_pointer_to_its_file():
    table = "\n".join(f"| {i} | + layers.{i}.mlp.down_proj | {'x' * 200} |" for i in range(2000))
    man = _manifest(_results(), {"Accuracy budget": {"markdown": table, "file": "quantize/budget.md"},
                                 "Deploy notes": {"markdown": "# Deploying x\n\nshort notes\n\n## KV\n```\n# cmd\n```"}})
    report = M.report_markdown(man)
    assert len(report.encode()) < 10_000
    assert "## Deploy notes\n\n### Deploying x\n\nshort notes\n\n#### KV\n```\n# cmd\n```" in report  # nested, fences kept
    kept = report.split("## Accuracy budget\n\n")[1].split("\n\n... ")[0].splitlines()
    assert kept == table.splitlines()[:len(kept)] and 0 < len(kept) <= M.SECTION_MAX_LINES
    assert f"... {2000 - len(kept)} more lines: the full section is in `quantize/budget.md`" in report
    lines = M.capped_section("\n".join(f"line {i}" for i in range(100)), None, max_lines=3)
    assert lines == "line 0\nline 1\nline 2\n\n... 97 more lines: the full section is in manifest.json (`sections`)"


def test_the_speed_line_counts_the_gemms_left_in_high_precision():
    """An INT8 speedup below what the INT8 GEMMs alone give is explained in numbers: the GEMMs
    kept in high precision run at FP32 speed."""
    metrics = {"speedup_vs_fp32": 1.404, "speed_shape": "batch 8 x 64 tokens", "speed_runs": 5, "speed_level": "all"}
    quantize = {"precision": "int8", "quantized_nodes": [f"q{i}" for i in range(30)],
                "excluded_nodes": [f"down_proj{i}" for i in range(6)]}
    [_, line] = M.speed_lines(metrics, quantize)
    assert line == ("Speed: 1.40x FP32 (batch 8 x 64 tokens, median of 5 interleaved runs, ONNX Runtime level 'all'); "
                    "30 of 36 GEMMs run in int8; the other 6, kept in high precision for accuracy, run at FP32 speed "
                    "and bound the speedup.")
    assert M.speed_lines(metrics, {**quantize, "excluded_nodes": []})[1].endswith("30 of 30 GEMMs run in int8.")
    assert M.speed_lines({}, quantize) == [] and M.speed_lines(metrics, {}) == []
    fp8 = M.speed_lines({"speedup_vs_fp32": 0.41}, {**quantize, "precision": "fp8"})[1]
    assert fp8 == ("Speed: 0.41x FP32; 30 of 36 GEMMs run in fp8 Q/DQ, simulated on this CPU (quantize, "
                   "dequantize, FP32 GEMM), so they are the slower ones.")
    assert "simulated" in M.speed_lines({**metrics, "speed_level": "basic"}, quantize)[1]
    man = _manifest(_results())
    man["metrics"].update(metrics)
    man["artifacts"] = {"quantize": quantize}
    assert line in M.report_markdown(man)


def test_a_nan_fraction_prints_no_unit_or_percentage():
    [res] = gates.evaluate([Gate(metric="relative_perplexity_increase", max=0.01)],
                           {"relative_perplexity_increase": None})
    assert res.unit == "fraction"
    assert res.message == "max_relative_perplexity_increase FAILED: relative_perplexity_increase = nan (bound <= 0.01)"


def test_junit_parses_when_a_failed_stage_says_control_characters_and_ansi_colours():
    import xml.etree.ElementTree as ET

    man = _manifest(_results())
    man["stages"]["export"] = M.stage_record("failed", "bad <tag> & \x01 \x1b[31mred\x1b[0m \"q\"", 1.0, 10.0)
    root = ET.fromstring(M.junit_xml(man))
    error = root.find("testcase[@classname='stages']/error")
    assert error is not None and error.get("message") == 'bad <tag> &  red "q"'
