from __future__ import annotations

import numpy as np
import pytest

from pipeline.checks import tolerance as compare
from pipeline.errors import AccuracyError


def test_close_values_pass_and_far_values_fail():
    ref = np.array([1.0, 2.0, 3.0], np.float32)
    assert compare.tensor("y", ref, ref + 1e-6, 1e-4, 1e-4)["passed"]
    r = compare.tensor("y", ref, ref + [0, 0, 1], 1e-4, 1e-4)
    assert not r["passed"] and r["mismatched"] == 1 and r["max_abs_err"] == pytest.approx(1.0)


def test_nonfinite_candidate_fails_where_reference_is_finite():
    ref = np.ones(4, np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        got = ref.copy()
        got[2] = bad
        r = compare.tensor("y", ref, got, 1.0, 1.0)
        assert not r["passed"] and r["nonfinite_in_candidate"] == 1


def test_nan_in_reference_is_an_error_not_a_pass():
    ref = np.array([1.0, np.nan], np.float32)
    with pytest.raises(AccuracyError, match="reference holds NaN"):
        compare.tensor("logits", ref, ref, 1.0, 1.0)


def test_empty_and_mismatched_comparisons_are_impossible():
    with pytest.raises(AccuracyError, match="zero elements"):
        compare.tensor("y", np.zeros((0, 3)), np.zeros((0, 3)), 1, 1)
    with pytest.raises(AccuracyError, match="shape"):
        compare.tensor("y", np.zeros(3), np.zeros(4), 1, 1)
    with pytest.raises(AccuracyError):
        compare.outputs([], [], [], 1, 1)


def test_matching_infinities_pass():
    ref = np.array([-np.inf, 1.0])
    assert compare.tensor("mask", ref, ref.copy(), 1e-4, 1e-4)["passed"]


def test_tolerances_depend_on_precision():
    assert compare.tolerance("fp32") < compare.tolerance("fp16") < compare.tolerance("fp8")
    assert compare.tolerance("int8", (0.5, 0.5)) == (0.5, 0.5)
    with pytest.raises(AccuracyError, match="valid"):
        compare.tolerance("fp4")


def test_per_output_overrides_win_over_the_default():
    from pipeline.recipe.schema import Tolerance

    ref = [np.ones(3), np.ones(3)]
    got = [np.ones(3) + 0.05, np.ones(3) + 0.05]
    per = {"logits": Tolerance(rtol=0.1, atol=0.1)}
    r = compare.outputs(ref, got, ["logits", "present.0.key"], 1e-4, 1e-4, per_output=per)
    assert not r["passed"] and r["worst"].startswith("present.0.key")
    per["present.*"] = Tolerance(rtol=0.1, atol=0.1)
    assert compare.outputs(ref, got, ["logits", "present.0.key"], 1e-4, 1e-4, per_output=per)["passed"]
