"""Quality statistics (pipeline/metrics/llm_quality.py) against direct numpy formulas
on a case small enough to check by hand: 2 windows x 4 tokens (3 scored positions) x vocab 4."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.metrics.llm_quality import QUALITY_KEYS, QualityAccumulator, logsumexp64
from pipeline.metrics.uncertainty import resample_counts
from pipeline.models.text_generation.metrics import mean_nll

IDS = np.array([[0, 1, 2, 3], [3, 3, 0, 1]], dtype=np.int64)
# Reference: position t favours token t+1 of each window; candidate: same with one flipped argmax.
REF = np.array([
    [[0, 2, 0, 0], [0, 0, 2, 0], [0, 0, 0, 2], [0, 0, 0, 0]],
    [[0, 0, 0, 2], [2, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]],
], dtype=np.float32)
CAND = np.array([
    [[0, 2, 0, 0], [0, 0, 1, 0], [0, 0, 3, 2], [5, 0, 0, 0]],
    [[0, 0, 0, 2], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]],
], dtype=np.float32)


def _direct():
    """Per-token values with plain numpy: softmax over each scored position."""
    def probs(x):
        e = np.exp(x[:, :-1].astype(np.float64))
        return e / e.sum(-1, keepdims=True)
    p, q = probs(REF), probs(CAND)
    tgt = IDS[:, 1:]
    pr = np.take_along_axis(p, tgt[..., None], -1)[..., 0]
    pc = np.take_along_axis(q, tgt[..., None], -1)[..., 0]
    kld = (p * np.log(p / q)).sum(-1)
    same = p.argmax(-1) == q.argmax(-1)
    return -np.log(pr).ravel(), -np.log(pc).ravel(), kld.ravel(), (pc - pr).ravel(), same.ravel()


def test_hand_case_matches_direct_formulas():
    acc = QualityAccumulator(context=1, chunk=2)
    acc.add(REF, CAND, IDS)
    got = acc.summary()
    nll_r, nll_c, kld, dp, same = _direct()
    n = 6
    # by hand: window 0 position 1 favours 2 in both (logit 2 vs 1); position 2 flips 3 -> 2;
    # window 1 agrees at all three positions -> 5 of 6 argmaxes agree.
    assert got["top1_agreement"] == pytest.approx(5 / 6)
    # window 1, position 0: identical rows -> KLD 0 and delta p 0 there.
    assert kld[3] == pytest.approx(0.0, abs=1e-15) and dp[3] == pytest.approx(0.0, abs=1e-15)
    # position 0 of window 0: p_ref(1) = e^2 / (e^2 + 3), same in the candidate.
    assert nll_r[0] == pytest.approx(-math.log(math.e**2 / (math.e**2 + 3)))
    d = nll_c - nll_r
    ratio = math.exp(d.mean())
    assert got["perplexity_ratio"] == pytest.approx(ratio, rel=1e-12)
    assert got["perplexity_ratio"] == pytest.approx(math.exp(nll_c.mean()) / math.exp(nll_r.mean()), rel=1e-12)
    # paired bootstrap over the 2 windows: each resample draws windows (a, b) with counts
    # (c0, c1), and the ratio is exp((c0 d_0 + c1 d_1) / (3 c0 + 3 c1)), d_w the window's summed d
    counts = resample_counts(2)
    dw, sw, kw = d.reshape(2, 3).sum(1), same.reshape(2, 3).sum(1), kld.reshape(2, 3).sum(1)
    boot = [math.exp((c @ dw) / (3 * c.sum())) for c in counts]
    assert got["perplexity_ratio_stderr"] == pytest.approx(np.std(boot, ddof=1), rel=1e-12)
    assert got["top1_agreement_stderr"] == pytest.approx(np.std([(c @ sw) / (3 * c.sum()) for c in counts], ddof=1))
    assert got["kld_mean_stderr"] == pytest.approx(np.std([(c @ kw) / (3 * c.sum()) for c in counts], ddof=1))
    assert n == 6 and got["perplexity_ratio_stderr"] > 0
    assert got["kld_mean"] == pytest.approx(kld.mean(), rel=1e-12)
    assert got["kld_max"] == pytest.approx(kld.max(), rel=1e-12)
    for key, q in (("kld_p50", 50), ("kld_p90", 90), ("kld_p99", 99), ("kld_p999", 99.9)):
        assert got[key] == pytest.approx(np.percentile(kld, q), rel=1e-12, abs=1e-15)
    assert got["delta_p_rms"] == pytest.approx(math.sqrt((dp**2).mean()), rel=1e-12)
    assert got["delta_p_p01"] == pytest.approx(np.percentile(dp, 1), rel=1e-12)
    assert got["delta_p_p99"] == pytest.approx(np.percentile(dp, 99), rel=1e-12)
    assert list(got) == list(QUALITY_KEYS)
    assert got["kld_mean"] > 0 and got["perplexity_ratio"] > 1  # the candidate is worse here


def test_logsumexp64_equals_scipys_and_keeps_its_rules_for_non_finite_rows():
    from scipy.special import logsumexp

    z = np.random.default_rng(3).standard_normal((5, 4096)) * 30
    np.testing.assert_allclose(logsumexp64(z), logsumexp(z, axis=-1), rtol=1e-14, atol=0)
    odd = np.array([[0.0, np.inf], [0.0, -np.inf], [np.nan, 1.0], [-np.inf, -np.inf]])
    np.testing.assert_array_equal(logsumexp64(odd), logsumexp(odd, axis=-1))
    mixed = np.concatenate([z[:2, :2], odd])  # the finite rows keep their own value: row by row
    np.testing.assert_array_equal(logsumexp64(mixed)[:2], logsumexp64(z[:2, :2]))
    np.testing.assert_array_equal(logsumexp64(np.zeros((2, 0))), [-np.inf, -np.inf])


def test_one_batch_equals_several_and_perplexity_sums_match_mean_nll():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(5, 7, 11)).astype(np.float32)
    cand = (ref + 0.3 * rng.normal(size=ref.shape)).astype(np.float32)
    ids = rng.integers(0, 11, size=(5, 7))
    whole = QualityAccumulator(context=2, chunk=64)
    whole.add(ref, cand, ids)
    split = QualityAccumulator(context=2, chunk=3)
    for lo, hi in ((0, 2), (2, 3), (3, 5)):
        split.add(ref[lo:hi], cand[lo:hi], ids[lo:hi])
    a, b = whole.summary(), split.summary()
    for key in QUALITY_KEYS:
        assert a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-15), key
    assert whole.tokens == split.tokens == 5 * 5
    # the NLL sums are mean_nll's, so perplexity_fp32 / perplexity_<precision> keep their values
    assert whole.nll_sum_ref == mean_nll(ref, ids, 2)[0]
    assert whole.nll_sum_cand == mean_nll(cand, ids, 2)[0]


def test_identical_logits_give_ratio_one_and_zero_kld():
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(2, 5, 9)).astype(np.float32)
    acc = QualityAccumulator()
    acc.add(ref, ref.copy(), rng.integers(0, 9, size=(2, 5)))
    got = acc.summary()
    assert got["perplexity_ratio"] == 1.0 and got["perplexity_ratio_stderr"] == 0.0
    assert got["kld_max"] == pytest.approx(0.0, abs=1e-15) and got["top1_agreement"] == 1.0
    assert got["delta_p_rms"] == 0.0


def test_nan_candidate_gives_none_with_reason():
    acc = QualityAccumulator()
    cand = CAND.copy()
    cand[0, 1, 2] = np.nan
    acc.add(REF, cand, IDS)
    got = acc.summary()
    assert got["kld_mean"] is None and got["perplexity_ratio"] is None
    assert "1 of 6 scored tokens" in got["quality_statistics_reason"]


def test_bad_shapes_and_context_are_refused():
    with pytest.raises(ValueError, match="context=0"):
        QualityAccumulator(context=0)
    acc = QualityAccumulator(context=4)
    with pytest.raises(ValueError, match="window length 4"):
        acc.add(REF, CAND, IDS)
    with pytest.raises(ValueError, match="must be"):
        QualityAccumulator().add(REF, CAND[:, :3], IDS)
    with pytest.raises(ValueError, match="at least 2"):
        QualityAccumulator().summary()


def test_paired_perplexity_equals_each_model_alone():
    """Both models per window batch (validate's path) give perplexity()'s numbers, bit for bit."""
    from pipeline.context import Progress
    from pipeline.metrics.llm_quality import paired_perplexity
    from pipeline.models.text_generation.metrics import perplexity

    rng = np.random.default_rng(3)
    windows = rng.integers(0, 13, size=(5, 9))
    table_r, table_c = rng.normal(size=(13, 13)), rng.normal(size=(13, 13))
    run_r = lambda ids: table_r[ids].astype(np.float32)  # noqa: E731  (a bigram "model")
    run_c = lambda ids: (table_r + 0.2 * table_c)[ids].astype(np.float32)  # noqa: E731
    progress = Progress(quiet=True)
    ppl_r, ppl_c, stats = paired_perplexity(run_r, run_c, windows, 2, progress, "int8", context=1)
    assert ppl_r == perplexity(run_r, windows, 2, progress, "fp32", 1)
    assert ppl_c == perplexity(run_c, windows, 2, progress, "int8", 1)
    assert stats["perplexity_ratio"] == pytest.approx(ppl_c / ppl_r, rel=1e-12)


def test_paired_perplexity_refuses_nan_reference():
    from pipeline.context import Progress
    from pipeline.errors import AccuracyError
    from pipeline.metrics.llm_quality import paired_perplexity

    nan = lambda ids: np.full((*ids.shape, 4), np.nan, np.float32)  # noqa: E731
    with pytest.raises(AccuracyError, match="FP32 reference produced NaN"):
        paired_perplexity(nan, nan, IDS, 2, Progress(quiet=True), "fp8")


def test_speedup_is_the_ratio_of_interleaved_medians(monkeypatch):
    """Deterministic clock: reference calls take 10, 30, 20 ms; candidate calls 5, 5, 50 ms."""
    from pipeline.metrics import speed

    durations = iter([10, 5, 30, 5, 20, 50])
    now = [0.0]

    def clock():
        return now[0]

    calls = []

    def make(label):
        def run():
            calls.append(label)
            if len(calls) > 2:  # after the warm-up pair
                now[0] += next(durations) / 1e3
        return run

    monkeypatch.setattr(speed.time, "perf_counter", clock)
    out = speed.speedup_metrics(make("ref"), make("cand"), shape="prefill 1 x 8", precision="fp8", level="basic",
                                runs=3, warmup=1)
    assert calls == ["ref", "cand"] * 4  # warm-up pair, then interleaved
    assert out["latency_fp32_ms"] == pytest.approx(20.0) and out["latency_candidate_ms"] == pytest.approx(5.0)
    assert out["speedup_vs_fp32"] == pytest.approx(4.0)
    assert out["speedup_vs_fp32_margin"] == speed.SPEEDUP_MARGIN
    assert "say nothing about FP8 speed on a GPU" in out["speed_note"]
    assert "GPU" in speed.speed_note("int8", "all") and "CPU targets" in speed.speed_note("int8", "all")
    with pytest.raises(ValueError, match="runs=0"):
        speed.time_pair(make("ref"), make("cand"), runs=0)


def test_every_statistic_can_be_a_text_generation_gate():
    from pipeline.recipe.gates import kind_metrics

    from pipeline.recipe.gates import STDERR_SUFFIX

    statistics = {k for k in QUALITY_KEYS if not k.endswith(STDERR_SUFFIX)}
    assert statistics | {"speedup_vs_fp32"} <= kind_metrics("text-generation")
    # a standard error measures the eval, not the model: it is no gate metric
    assert not {k for k in QUALITY_KEYS if k.endswith(STDERR_SUFFIX)} & kind_metrics("text-generation")


def test_int8_speed_note_names_the_faster_option_and_the_deciding_cpu_flags():
    from pipeline.metrics import speed

    basic = speed.int8_note("basic", ["avx2", "avx512f", "avx512_vnni"])
    assert "quantize.reduce_range: true" in basic and "This CPU has avx512_vnni" in basic
    plain = speed.int8_note("all", ["avx2"])
    assert "none of avx512_vnni, avx_vnni, amx_int8" in plain and "keep precision fp32" in plain
    assert "reduce_range" not in plain  # already 7-bit
    assert speed.int8_note("all", ["avx2"]) in speed.speed_note("int8", "all", flags=["avx2"])
    out = speed.speedup_metrics(lambda: None, lambda: None, shape="s", precision="int8", level="all", runs=1)
    assert out["speed_level"] == "all" and isinstance(out["speed_cpu_flags"], list)
