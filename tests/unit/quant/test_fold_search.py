"""The fold-point scale search (pipeline.quant.fold_search) on synthetic activations: no scaling
without an outlier, an outlier channel scaled, never worse than no folding, ties to the smaller
alpha, deterministic; and the INT4 round-to-nearest block math it searches with (pipeline.quant.int4)."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.errors import QuantizationError
from pipeline.quant import fold_search, int4


def _int4(bs: int = 32):
    return lambda w: int4.fake_quantize(w, bs)


def _data(outlier: float, seed: int = 0, c: int = 64, n: int = 512):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c)).astype(np.float32)
    x[:, 5] *= outlier
    ws = [rng.standard_normal((c, 48)).astype(np.float32), rng.standard_normal((c, 16)).astype(np.float32)]
    return x, ws


def test_rtn_block_math_matches_numpy():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 128)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (6, 1))).astype(np.float32)
    w[2, 64:96] = 0.0  # an all-zero block: scale 1, values 0
    for bs in (32, 64, 128):
        form = int4.rtn_form(w, bs)
        blocks = w.reshape(6, 128 // bs, bs).astype(np.float64)
        amax = np.abs(blocks).max(axis=2)
        want_scale = np.where(amax > 0, (amax / 7).astype(np.float32), 1.0)
        assert np.array_equal(form.scales, want_scale.astype(np.float32)) and (form.scales > 0).all()
        assert form.values.min() >= -7 and form.values.max() <= 7 and form.offsets is None
        want = np.clip(np.round(blocks / want_scale[:, :, None]), -7, 7).reshape(6, 128)
        assert np.array_equal(form.values, want.astype(np.int8))
        # every element within half a step of its block; the block's absmax lands on +-7 exactly
        step = np.repeat(want_scale, bs, axis=1)
        assert (np.abs(form.dequantized() - w) <= 0.5 * step * (1 + 1e-6)).all()
        assert np.array_equal(np.abs(form.values).reshape(6, -1, bs).max(axis=2)[amax > 0], np.full((amax > 0).sum(), 7))
    # fake_quantize is the same math on a MatMul's [K, N] weight, blocks along K, bit for bit (the
    # search's loss sees what rtn_form writes), for 4 and 8 bits, on a non-contiguous view too
    for bs, bits in ((32, 4), (64, 4), (128, 4), (32, 8)):
        assert np.array_equal(int4.fake_quantize(w.T, bs, bits), int4.rtn_form(w, bs, bits).dequantized().T)
    assert np.array_equal(int4.fake_quantize(np.ascontiguousarray(w.T), 64), int4.fake_quantize(w.T, 64))
    # padded (K = 576 at block 128): the same as rtn_form's padded blocks, the zero rows dropped
    wk = np.random.default_rng(3).standard_normal((576, 8)).astype(np.float32)
    padded = int4.fake_quantize(wk, 128, pad=True)
    assert padded.shape == (576, 8)
    assert np.array_equal(padded, int4.rtn_form(np.ascontiguousarray(wk.T), 128, pad=True).dequantized().T[:576])
    assert int4.rtn_form(w, 32, bits=8).values.max() <= 127


def test_fake_quantize_refuses_a_partial_block_and_non_finite_weights():
    with pytest.raises(QuantizationError, match="block size 128 does not divide .* K = 576"):
        int4.fake_quantize(np.ones((576, 4), np.float32), 128)
    for bad in (np.nan, np.inf):
        w = np.ones((64, 4), np.float32)
        w[10, 2] = bad
        with pytest.raises(QuantizationError, match="NaN or infinite"):
            int4.fake_quantize(w, 32)


def test_block_not_dividing_k_is_refused():
    with pytest.raises(QuantizationError, match=r"MatMul 'x'.*block_size 128 does not divide .* K = 576.*32, 64"):
        int4.rtn_form(np.ones((4, 576), np.float32), 128, name="MatMul 'x'")


def test_no_outlier_keeps_alpha_zero():
    x, ws = _data(outlier=1.0)
    x = np.sign(x) + (x == 0)  # random signs, |x| = 1 everywhere: mean |x| is flat, every candidate is s = 1
    res = fold_search.search(x, ws, _int4())
    assert res.alpha == 0.0 and not res.scaled and res.loss == res.baseline
    assert all(v == res.baseline for v in res.losses.values())  # a tie everywhere goes to alpha 0


def test_outlier_channel_is_scaled_and_loss_drops():
    x, ws = _data(outlier=40.0)
    res = fold_search.search(x, ws, _int4())
    assert res.alpha is not None and res.alpha > 0
    assert res.scales[5] == res.scales.max() and res.scales[5] > 3 * np.median(res.scales)
    assert res.loss < 0.8 * res.baseline
    # the reported loss is the block output error of the returned scales
    again = fold_search.block_output_error(x, ws, res.row_scales, _int4())
    assert again == pytest.approx(res.loss, rel=1e-9)
    # deterministic: the same inputs give the same bytes
    assert np.array_equal(fold_search.search(x, ws, _int4()).scales, res.scales)


def test_never_worse_than_no_folding():
    for seed in range(4):
        x, ws = _data(outlier=1.0, seed=seed)
        for family in fold_search.FAMILIES:
            res = fold_search.search(x, ws, _int4(), family=family)
            assert res.loss <= res.baseline
            assert res.loss == min([res.baseline, *res.losses.values()])


def test_smoothquant_family_with_activation_quantizer():
    x, ws = _data(outlier=60.0)

    def act8(a):  # per-tensor symmetric INT8 fake quantization, amax = max |a|
        s = np.abs(a).max() / 127
        return (np.clip(np.rint(a / s), -127, 127) * s).astype(np.float32)

    res = fold_search.search(x, ws, lambda w: int4.fake_quantize(w, 64, bits=8), act8, family="smoothquant")
    assert res.family == "smoothquant" and res.loss < 0.5 * res.baseline and res.scales[5] == res.scales.max()


def test_tied_groups_share_one_scale():
    x, ws = _data(outlier=30.0, c=64)
    groups = np.arange(64) % 16  # 4 rows per site channel: channel 5 ties rows 5, 21, 37, 53
    res = fold_search.search(x, ws[:1], _int4(), groups=groups)
    assert res.scales.shape == (16,) and np.array_equal(res.row_scales, res.scales[groups])
    assert res.scales[5] == res.scales.max()
    with pytest.raises(QuantizationError, match="groups"):
        fold_search.search(x, ws, _int4(), groups=np.arange(64) % 16 + 1)


def test_bad_shapes_are_refused():
    x, ws = _data(outlier=1.0)
    with pytest.raises(QuantizationError, match=r"\(10, 48\)"):
        fold_search.search(x, [np.ones((10, 48), np.float32)], _int4())
    with pytest.raises(QuantizationError, match="family"):
        fold_search.search(x, ws, _int4(), family="gptq")


def test_clip_search_never_grows_a_blocks_error_and_clips_heavy_tails():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((256, 128)).astype(np.float32)
    w = rng.standard_t(2.5, size=(128, 24)).astype(np.float32)  # heavy tails: one large weight per block
    ratios = int4.clip_search(x, w, 32)
    assert ratios.shape == (24, 4) and set(np.unique(ratios)) <= set(np.float32(int4.CLIP_GRID)) and (ratios < 1).any()

    def block_err(clip):
        q = int4.rtn_form(np.ascontiguousarray(w.T), 32, clip=clip).dequantized().T
        d = (w - q).astype(np.float64)
        return np.array([[np.sum((x[:, b * 32:(b + 1) * 32] @ d[b * 32:(b + 1) * 32, o]) ** 2) for b in range(4)]
                         for o in range(24)])

    plain, clipped = block_err(None), block_err(ratios)
    assert (clipped <= plain * (1 + 1e-9)).all() and clipped.sum() < 0.95 * plain.sum()
    with pytest.raises(QuantizationError, match="clip ratios"):
        int4.rtn_form(np.ascontiguousarray(w.T), 32, clip=np.zeros((24, 4), np.float32))
