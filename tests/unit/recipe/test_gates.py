"""Accuracy gates: one list type, checked against the model kind's metrics
at `check` time, evaluated on measured metrics; the flat gate fields of older recipes
are refused with the new form."""
from __future__ import annotations

import math

import pytest
import yaml
from pydantic import ValidationError

from conftest import ROOT
from pipeline.recipe import gates
from pipeline.cli.app import main
from pipeline.errors import InternalError, RecipeError
from pipeline.recipe.schema import Gate
from pipeline.recipe.load import load_recipe
from pipeline.recipe import kinds

LLM = ROOT / "recipes" / "fp8-llm.yaml"
ENCODER = ROOT / "recipes" / "int8-encoder.yaml"


def _write(tmp_path, source, mutate) -> str:
    data = yaml.safe_load(source.read_text())
    mutate(data)
    path = tmp_path / source.name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


# --- the Gate type --------------------------------------------------------------------------

def test_a_gate_has_a_metric_and_one_bound_and_a_default_name():
    hi = Gate.model_validate({"metric": "relative_perplexity_increase", "max": 0.015})
    lo = Gate.model_validate({"metric": "mean_cosine", "min": 0.99, "name": "cosine"})
    assert (hi.label, hi.max, hi.min) == ("max_relative_perplexity_increase", 0.015, None)
    assert (lo.label, lo.max, lo.min) == ("cosine", None, 0.99)
    assert Gate(metric="token_agreement", min=0.5).label == "min_token_agreement"


@pytest.mark.parametrize(
    "spec, expect",
    [
        ({"metric": "mean_cosine"}, "give exactly one bound, max: <x> or min: <x> (got neither)"),
        ({"metric": "mean_cosine", "min": 0.9, "max": 1.0}, "give exactly one bound, max: <x> or min: <x> (got both)"),
        ({"metric": "mean_cosine", "min": float("nan")}, "min\n  Input should be a finite number"),
        ({"metric": "engine.mean_cosine", "min": 0.9}, "metric\n  String should match pattern"),
        ({"metric": "mean_cosine", "minimum": 0.9}, "minimum\n  Extra inputs are not permitted"),
    ],
)
def test_a_gate_without_exactly_one_finite_bound_is_refused(spec, expect):
    with pytest.raises(ValidationError) as err:
        Gate.model_validate(spec)
    assert expect in str(err.value)


# --- metrics per kind -------------------------------------------------------------------------

def test_kind_metrics_cover_old_and_new_kind_names():
    assert gates.kind_metrics("text-generation") == gates.kind_metrics("causal-lm") >= {
        "relative_perplexity_increase", "token_agreement"}
    assert gates.kind_metrics("sentence-embedding") == gates.kind_metrics("encoder") == {
        "spearman_drop_wordsim353", "spearman_drop_simlex999", "spearman_drop_max", "mean_cosine", "min_cosine",
        "speedup_vs_fp32"}
    assert gates.kind_metrics("image-classification") == {"top1_accuracy_drop", "top1_agreement"}
    assert gates.kind_metrics("generic") >= {"mean_cosine", "min_cosine", "top1_agreement"}
    with pytest.raises(KeyError, match="model kind 'speech' has no row in pipeline.recipe.kinds.KINDS; rows: "):
        gates.kind_metrics("speech")


def test_problems_name_the_gate_index_and_the_valid_metrics():
    listed = [Gate(metric="mean_cosine", min=0.9), Gate(metric="top1_agreement", min=0.9),
              Gate(metric="mean_cosine", min=0.95)]
    assert gates.problems(listed, "sentence-embedding", ("quantize", "accuracy_budget")) == [
        (("quantize", "accuracy_budget", 1, "metric"),
         f"'top1_agreement' is not a metric of a sentence-embedding model; valid: "
         f"{sorted(gates.kind_metrics('sentence-embedding'))}"),
        (("quantize", "accuracy_budget", 2), "gate name 'min_mean_cosine' is also the name of gate 0; give one of "
         "them its own name (name: <text>)"),
    ]
    assert gates.problems(listed[:1], "speech", ("validate", "gates")) == [
        (("validate", "gates"), f"model kind 'speech' has no row in pipeline.recipe.kinds.KINDS; rows: {sorted(kinds.KINDS)}")]
    assert gates.problems(listed[:1], "speech", ("validate", "gates")) and not gates.problems([], "speech", ("x",))


def test_a_standard_error_is_no_gate_metric_and_points_to_its_metric():
    assert not any(m.endswith(gates.STDERR_SUFFIX) for kind in kinds.KINDS for m in gates.kind_metrics(kind))
    (problem,) = gates.problems([Gate(metric="kld_mean_stderr", max=0.001)], "text-generation", ("validate", "gates"))
    assert problem[0] == ("validate", "gates", 0, "metric")
    assert problem[1].endswith("; it is the standard error of kld_mean: gate kld_mean with statistic: "
                               "evidence_of_regression or evidence_of_meeting")
    assert "'kld_mean_stderr'" not in problem[1].split("valid:")[1]


def test_check_refuses_a_metric_the_kind_does_not_produce(tmp_path, capsys):
    path = _write(tmp_path, ENCODER, lambda d: d["validate"]["gates"].append({"metric": "top1_agreement", "min": 0.9}))
    assert main(["check", path]) == 2
    err = capsys.readouterr().err
    line = next(i for i, t in enumerate(open(path).read().splitlines(), 1) if "top1_agreement" in t)
    assert (f"{path}:{line}: validate.gates.2.metric: 'top1_agreement' is not a metric of a sentence-embedding "
            "model; valid: ['mean_cosine', 'min_cosine', 'spearman_drop_max', 'spearman_drop_simlex999', "
            "'spearman_drop_wordsim353', 'speedup_vs_fp32']") in err


def test_per_set_spearman_gates_are_accepted_for_encoders(tmp_path):
    path = _write(tmp_path, ENCODER, lambda d: d["validate"].update(gates=[
        {"metric": "spearman_drop_wordsim353", "max": 0.5}, {"metric": "min_cosine", "min": 0.9}]))
    assert [g.label for g in load_recipe(path).validate_.gates] == ["max_spearman_drop_wordsim353", "min_min_cosine"]


# --- evaluation -----------------------------------------------------------------------------------

METRICS = {"relative_perplexity_increase": 0.01, "token_agreement": 0.30, "mean_cosine": None,
           "engine.relative_perplexity_increase": 0.02, "min_cosine": math.nan}


@pytest.mark.parametrize(
    "gate, passed, value, message",
    [
        (Gate(metric="relative_perplexity_increase", max=0.015), True, 0.01,
         "max_relative_perplexity_increase passed: relative_perplexity_increase = 0.01 (+1.00 %; bound <= 0.015)"),
        (Gate(metric="relative_perplexity_increase", max=0.005), False, 0.01,
         "max_relative_perplexity_increase FAILED: relative_perplexity_increase = 0.01 (+1.00 %; bound <= 0.005)"),
        (Gate(metric="relative_perplexity_increase", max=0.01), True, 0.01,
         "max_relative_perplexity_increase passed: relative_perplexity_increase = 0.01 (+1.00 %; bound <= 0.01)"),
        (Gate(metric="token_agreement", min=0.3, name="greedy"), True, 0.3,
         "greedy passed: token_agreement = 0.3 (bound >= 0.3)"),
        (Gate(metric="token_agreement", min=0.5), False, 0.3,
         "min_token_agreement FAILED: token_agreement = 0.3 (bound >= 0.5)"),
        (Gate(metric="mean_cosine", min=-1.0), False, math.nan, "min_mean_cosine FAILED: mean_cosine = nan (bound >= -1)"),
        (Gate(metric="min_cosine", max=1.0), False, math.nan, "max_min_cosine FAILED: min_cosine = nan (bound <= 1)"),
    ],
)
def test_evaluate_max_min_and_null(gate, passed, value, message):
    [res] = gates.evaluate([gate], METRICS)
    assert res.passed is passed and res.message == message
    assert res.value == value or (math.isnan(value) and math.isnan(res.value))


def test_evaluate_reads_the_engine_metrics_with_the_prefix():
    listed = [Gate(metric="relative_perplexity_increase", max=0.015)]
    [plain] = gates.evaluate(listed, METRICS)
    [engine] = gates.evaluate(listed, METRICS, prefix="engine.")
    assert plain.passed and (plain.metric, plain.value) == ("relative_perplexity_increase", 0.01)
    assert not engine.passed and (engine.metric, engine.value, engine.op, engine.bound) == (
        "engine.relative_perplexity_increase", 0.02, "<=", 0.015)
    assert engine.message == ("max_relative_perplexity_increase FAILED: engine.relative_perplexity_increase = 0.02 "
                              "(+2.00 %; bound <= 0.015)")


def test_evaluate_keeps_the_gate_order_and_a_missing_metric_is_a_bug():
    listed = [Gate(metric="token_agreement", min=0.1), Gate(metric="relative_perplexity_increase", max=1.0)]
    assert [r.name for r in gates.evaluate(listed, METRICS)] == ["min_token_agreement",
                                                                "max_relative_perplexity_increase"]
    with pytest.raises(InternalError, match="gate 'min_token_agreement' needs metric 'engine.token_agreement', "
                                            "which was not measured"):
        gates.evaluate(listed, METRICS, prefix="engine.")


# --- older recipe shapes --------------------------------------------------------------------------

def test_flat_gates_are_refused_with_the_list_form(tmp_path):
    path = _write(tmp_path, LLM, lambda d: d["validate"].update(
        gates={"max_relative_perplexity_increase": 0.015, "min_token_agreement": 0.3}))
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    line = next(i for i, t in enumerate(open(path).read().splitlines(), 1) if t.strip() == "gates:")
    assert (f"{path}:{line}: validate.gates: flat gate fields were replaced by a list of {{metric: <name>, max: <x>}} "
            "or {metric: <name>, min: <x>}; write gates: [{metric: relative_perplexity_increase, max: 0.015}, "
            "{metric: token_agreement, min: 0.3}]") in str(err.value)


def test_encoder_flat_gates_map_to_their_metrics(tmp_path):
    path = _write(tmp_path, ENCODER, lambda d: d["validate"].update(
        gates={"max_spearman_drop": 1.0, "min_mean_cosine": 0.99}))
    with pytest.raises(RecipeError, match=r"write gates: \[\{metric: spearman_drop_max, max: 1\.0\}, "
                                          r"\{metric: mean_cosine, min: 0\.99\}\]"):
        load_recipe(path)


def test_validate_metric_is_refused(tmp_path):
    path = _write(tmp_path, LLM, lambda d: d["validate"].update(metric="perplexity"))
    with pytest.raises(RecipeError, match=r"validate\.metric: removed: it was never read \(the model kind decides "
                                          r"what validate measures\); delete it"):
        load_recipe(path)


@pytest.mark.parametrize(
    "key, expect",
    [
        ("validate.gates.max_relative_perplexity_increase",
         "--set validate.gates.max_relative_perplexity_increase: validate.gates is now a list; set the bound of the "
         "gate on relative_perplexity_increase by index (--set validate.gates.<i>.max=<x>) or give the whole list "
         "(--set 'validate.gates=[{metric: relative_perplexity_increase, max: <x>}]')"),
        ("validate.gates.min_mean_cosine", "(--set 'validate.gates=[{metric: mean_cosine, min: <x>}]')"),
        ("validate.metric", "--set validate.metric: removed (it was never read); drop this --set"),
    ],
)
def test_old_set_keys_are_refused_with_the_new_key(key, expect):
    with pytest.raises(RecipeError) as err:
        load_recipe(LLM, {key: 0.5})
    assert expect in str(err.value)


def test_cli_set_on_a_gate_bound(tmp_path, capsys):
    assert main(["check", str(LLM), "--set", "validate.gates.0.max=0.02"]) == 0
    assert main(["check", str(LLM), "--set", "validate.gates.0.min=0.02"]) == 2
    assert "validate.gates.0: Value error, give exactly one bound, max: <x> or min: <x> (got both) " \
           "[from --set validate.gates.0.min]" in capsys.readouterr().err
    whole = "validate.gates=[{metric: token_agreement, min: 0.2}, {metric: relative_perplexity_increase, max: 1}]"
    assert main(["check", str(LLM), "--set", whole]) == 0


def test_a_gate_on_too_few_eval_units_says_it_has_no_standard_error():
    """A truncated eval file (one window, one sample) still passes a point gate, but never silently."""
    [one] = gates.evaluate([Gate(metric="kld_mean", max=0.1)], {"kld_mean": 0.01, "kld_mean_stderr": None})
    assert one.passed and one.message == ("max_kld_mean passed: kld_mean = 0.01 nats (bound <= 0.1; "
                                          "no standard error: fewer than 2 eval units to resample)")
    [why] = gates.evaluate([Gate(metric="mean_cosine", min=0.9)],
                           {"mean_cosine": 0.99, "mean_cosine_stderr_reason": "one eval sample (y) has no spread"})
    assert why.message.endswith("(bound >= 0.9; no standard error: one eval sample (y) has no spread)")
    [extreme] = gates.evaluate([Gate(metric="min_cosine", min=0.9)], {"min_cosine": 0.99})
    assert "standard error" not in extreme.message  # a minimum never has one


def test_a_bound_is_printed_as_given_when_six_digits_would_round_it():
    [g] = gates.evaluate([Gate(metric="mean_cosine", min=0.9999999)], {"mean_cosine": 0.99999995})
    assert "(bound >= 0.9999999)" in g.message  # not "bound >= 1", which the value would seem to miss
