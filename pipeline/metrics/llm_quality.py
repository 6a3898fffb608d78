"""Quality statistics of a candidate causal LM against its FP32 reference, computed
the way llama.cpp's ``llama-perplexity --kl-divergence`` does
(``tools/perplexity/perplexity.cpp`` in ggml-org/llama.cpp: per scored token it
keeps the two NLLs, the KL divergence, the change in the probability of the
correct token and whether the two argmaxes agree; summaries come from those).

Streaming: :class:`QualityAccumulator` is fed one batch of windows at a time
(reference and candidate logits ``[batch, seq, vocab]``) and keeps only per-token
scalars (5 numbers per scored token), never the logits. Log-softmax runs in
float64 on ``chunk`` positions at a time, so extra memory is about
``4 * chunk * vocab * 8`` bytes (25 MB for chunk 16 and a 49152-token vocabulary).

Keys of :meth:`QualityAccumulator.summary` (``validate/metrics.json``):

* ``perplexity_ratio`` = PPL(cand) / PPL(ref) = exp(mean(d)), d_t = NLL_cand(t) - NLL_ref(t)
  (nats). ``perplexity_ratio_stderr``: its standard error by a paired bootstrap over
  eval windows (:mod:`pipeline.metrics.uncertainty`): whole windows are resampled with
  replacement and the ratio recomputed from their summed d and token counts. Unlike
  llama.cpp's ``sqrt(var(d) / (n - 1))`` it does not treat the tokens of a window as
  independent. ``kld_mean_stderr`` and ``top1_agreement_stderr``: the same bootstrap
  (same resamples) of those means. With one window the three are ``None``.
* ``kld_mean``, ``kld_p50``, ``kld_p90``, ``kld_p99``, ``kld_p999``, ``kld_max``:
  KL(ref || cand) = sum_v p_ref(v) (log p_ref(v) - log p_cand(v)) per token (nats);
  percentiles by linear interpolation (``numpy.percentile``).
* ``top1_agreement``: teacher-forced, fraction of scored positions whose argmax is the same.
* ``delta_p_rms``, ``delta_p_p01``, ``delta_p_p99``: delta_p = p_cand(correct) - p_ref(correct)
  (probability, not percent), RMS and 1st / 99th percentiles.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.special import logsumexp

from pipeline.metrics import uncertainty
from pipeline.recipe.gates import STDERR_SUFFIX

#: metric names written by :meth:`QualityAccumulator.summary` (all but the ``_stderr`` ones gateable).
QUALITY_KEYS: tuple[str, ...] = (
    "perplexity_ratio", "perplexity_ratio_stderr",
    "kld_mean", "kld_mean_stderr", "kld_p50", "kld_p90", "kld_p99", "kld_p999", "kld_max",
    "top1_agreement", "top1_agreement_stderr", "delta_p_rms", "delta_p_p01", "delta_p_p99",
)
#: the keys of :data:`QUALITY_KEYS` that have a bootstrap standard error (``<key>_stderr``)
STDERR_KEYS: tuple[str, ...] = ("perplexity_ratio", "kld_mean", "top1_agreement")

_KLD_PERCENTILES = {"kld_p50": 50.0, "kld_p90": 90.0, "kld_p99": 99.0, "kld_p999": 99.9}


def logsumexp64(lg: np.ndarray) -> np.ndarray:
    """``log sum_v exp(z_v)`` over the last axis of float64 ``[..., vocab]`` logits: float64 ``[...]``.

    The usual stable form, ``max(z) + log(sum_v exp(z_v - max(z)))``, row by row: on 16 x 49152
    logits 1.3 ms against 9.0 ms for ``scipy.special.logsumexp`` (whose general form handles signs,
    weights and complex input; the two agree to ~1e-16 absolute). A row whose maximum is not
    finite (an inf or nan logit), and an empty vocabulary, take scipy's (inf / nan / -inf by its rules)."""
    if lg.shape[-1] == 0:
        return logsumexp(lg, axis=-1)
    top = lg.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.asarray(np.log(np.exp(lg - top).sum(axis=-1)) + top[..., 0])
    odd = ~np.isfinite(top[..., 0])
    if odd.any():
        out[odd] = logsumexp(lg[odd], axis=-1)
    return out


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis of ``[positions, vocab]`` logits: z - logsumexp64(z), so
    ``-log_softmax64(z)[t]`` is bit for bit the NLL :func:`pipeline.models.text_generation.metrics.mean_nll`
    sums."""
    lg = logits.astype(np.float64)
    return lg - logsumexp64(lg)[..., None]


def reference_terms(log_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(p, sum_v p log p)`` of a reference log-softmax ``log_p`` float64 ``[n, V]``:
    float64 ``[n, V]`` and ``[n]``. What :func:`kl_from_reference` needs of the reference,
    so a reference scored against many candidates is exponentiated once."""
    p = np.exp(log_p)
    return p, (p * log_p).sum(axis=-1)


def kl_from_reference(p: np.ndarray, neg_entropy: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """Per-token KL(ref || cand) = sum_v p log p - sum_v p log q, in nats: float64 ``[n]``.

    ``p`` ``[n, V]`` (float32 or float64) and ``neg_entropy`` ``[n]`` from :func:`reference_terms`;
    ``log_q`` float64 ``[n, V]`` the candidate's :func:`log_softmax64`. Both sums reduce the same
    way, so identical logits give exactly 0. The one KL kernel of the package: the validate
    stage's :class:`QualityAccumulator` and the accuracy-budget search
    (:mod:`pipeline.quant.sensitivity`) both use it.
    """
    return neg_entropy - (p * log_q).sum(axis=-1)


class QualityAccumulator:
    """Per-token statistics of candidate vs reference logits, fed window batch by window batch.

    Position t of a window predicts token t+1; positions ``context - 1 .. seq - 2``
    are scored (``context`` leading tokens are context only, as
    :func:`pipeline.models.text_generation.metrics.mean_nll`).

    Args:
        context: leading tokens of each window never scored (>= 1).
        chunk: positions per float64 log-softmax block (memory bound, not results).

    Raises:
        ValueError: ``context`` < 1 or ``chunk`` < 1.
    """

    def __init__(self, context: int = 1, chunk: int = 16):
        if context < 1 or chunk < 1:
            raise ValueError(f"QualityAccumulator: context={context} and chunk={chunk} must both be >= 1")
        self.context, self.chunk = context, chunk
        self._parts: dict[str, list[np.ndarray]] = {k: [] for k in ("nll_ref", "nll_cand", "kld", "dp", "same")}
        #: running NLL sums (nats) in the order :func:`...metrics.perplexity` adds them:
        #: per batch, row sums added to 0.0, then the batch sum added to the total.
        self.nll_sum_ref = 0.0
        self.nll_sum_cand = 0.0

    def add(self, ref_logits: np.ndarray, cand_logits: np.ndarray, ids: np.ndarray) -> None:
        """Score one batch of windows.

        Args:
            ref_logits, cand_logits: ``[batch, seq, vocab]`` float (the reference at
                full precision: it is never rounded here).
            ids: int ``[batch, seq]`` token ids of the windows.

        Raises:
            ValueError: shapes disagree, or ``context`` leaves nothing to score.
        """
        if ref_logits.shape != cand_logits.shape or ref_logits.shape[:2] != ids.shape:
            raise ValueError(f"QualityAccumulator.add: reference logits {ref_logits.shape}, candidate logits "
                             f"{cand_logits.shape} and ids {ids.shape} must be [batch, seq, vocab] / [batch, seq]")
        if not self.context < ids.shape[1]:
            raise ValueError(f"context={self.context} must be below the window length {ids.shape[1]}")
        batch_ref = batch_cand = 0.0
        for ref, cand, tokens in zip(ref_logits, cand_logits, ids):
            row = self._row(ref[self.context - 1 : -1], cand[self.context - 1 : -1], tokens[self.context :])
            for key, values in row.items():
                self._parts[key].append(values)
            batch_ref += float(row["nll_ref"].sum())
            batch_cand += float(row["nll_cand"].sum())
        self.nll_sum_ref += batch_ref
        self.nll_sum_cand += batch_cand

    def _row(self, ref: np.ndarray, cand: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
        """Per-token scalars of one window's scored positions (``[n, vocab]`` logits, ``[n]`` targets)."""
        out: dict[str, list[np.ndarray]] = {k: [] for k in self._parts}
        for lo in range(0, len(targets), self.chunk):
            sl = slice(lo, lo + self.chunk)
            lr, lc = log_softmax64(ref[sl]), log_softmax64(cand[sl])
            kld = kl_from_reference(*reference_terms(lr), lc)
            tgt = targets[sl, None]
            pick_r = np.take_along_axis(lr, tgt, axis=-1)[:, 0]
            pick_c = np.take_along_axis(lc, tgt, axis=-1)[:, 0]
            out["nll_ref"].append(-pick_r)
            out["nll_cand"].append(-pick_c)
            out["kld"].append(kld)
            out["dp"].append(np.exp(pick_c) - np.exp(pick_r))
            out["same"].append(ref[sl].argmax(-1) == cand[sl].argmax(-1))
        return {k: np.concatenate(v) for k, v in out.items()}

    @property
    def tokens(self) -> int:
        """Scored tokens so far."""
        return sum(len(p) for p in self._parts["kld"])

    @property
    def windows(self) -> int:
        """Windows scored so far."""
        return len(self._parts["kld"])

    def window_sums(self, key: str) -> np.ndarray:
        """Per-window sums of ``key`` (as :meth:`values`; ``same`` counts matches): float64 ``[windows]``."""
        return np.array([p.sum(dtype=np.float64) for p in self._parts[key]])

    def window_tokens(self) -> np.ndarray:
        """Scored tokens per window: float64 ``[windows]``."""
        return np.array([len(p) for p in self._parts["kld"]], dtype=np.float64)

    def stderrs(self) -> dict[str, float | None]:
        """``<key>_stderr`` for :data:`STDERR_KEYS`: paired bootstrap over windows
        (:func:`pipeline.metrics.uncertainty.ratio_of_sums_stderr`, one set of resamples
        for all three); ``None`` with fewer than 2 windows."""
        names = [f"{k}{STDERR_SUFFIX}" for k in STDERR_KEYS]
        if self.windows < 2:
            return dict.fromkeys(names)
        counts, tokens = uncertainty.resample_counts(self.windows), self.window_tokens()
        d = self.window_sums("nll_cand") - self.window_sums("nll_ref")
        return dict(zip(names, (uncertainty.ratio_of_sums_stderr(d, tokens, np.exp, counts),
                                uncertainty.ratio_of_sums_stderr(self.window_sums("kld"), tokens, counts=counts),
                                uncertainty.ratio_of_sums_stderr(self.window_sums("same"), tokens, counts=counts))))

    def basis(self) -> dict[str, dict]:
        """``stderr_basis`` records (:func:`pipeline.metrics.uncertainty.basis`) of
        :data:`STDERR_KEYS`; empty with fewer than 2 windows."""
        if self.windows < 2:
            return {}
        rec = uncertainty.basis(self.tokens, "tokens", self.windows, "eval windows")
        return {k: dict(rec) for k in STDERR_KEYS}

    def values(self, key: str) -> np.ndarray:
        """All per-token values of ``key`` (``nll_ref``, ``nll_cand``, ``kld``, ``dp``, ``same``)."""
        parts = self._parts[key]
        return np.concatenate(parts) if parts else np.zeros(0)

    def summary(self) -> dict:
        """The statistics named in :data:`QUALITY_KEYS` (floats).

        A non-finite per-token value (NaN/inf candidate logits) makes every
        statistic ``None`` with ``quality_statistics_reason`` saying why.

        Raises:
            ValueError: fewer than 2 tokens were scored (no uncertainty can be given).
        """
        n = self.tokens
        if n < 2:
            raise ValueError(f"QualityAccumulator.summary: {n} scored token(s); at least 2 are needed")
        d = self.values("nll_cand") - self.values("nll_ref")
        kld, dp = self.values("kld"), self.values("dp")
        if not (np.isfinite(d).all() and np.isfinite(kld).all() and np.isfinite(dp).all()):
            bad = int((~np.isfinite(d) | ~np.isfinite(kld)).sum())
            return {**{k: None for k in QUALITY_KEYS},
                    "quality_statistics_reason": f"{bad} of {n} scored tokens have non-finite candidate statistics "
                                                 "(NaN/inf logits)"}
        out = {"perplexity_ratio": math.exp(float(d.mean())), **self.stderrs(),
               "kld_mean": float(kld.mean()), "kld_max": float(kld.max()),
               "top1_agreement": float(self.values("same").mean()),
               "delta_p_rms": math.sqrt(float(np.mean(dp * dp))),
               "delta_p_p01": float(np.percentile(dp, 1.0)), "delta_p_p99": float(np.percentile(dp, 99.0))}
        out.update({k: float(np.percentile(kld, q)) for k, q in _KLD_PERCENTILES.items()})
        return {k: out[k] for k in QUALITY_KEYS}


def paired_perplexity(run_ref, run_cand, windows: np.ndarray, batch: int, progress, label: str,
                      context: int = 1, acc: QualityAccumulator | None = None) -> tuple[float, float, dict]:
    """Run the reference and the candidate on each batch of windows and feed both
    logits to one :class:`QualityAccumulator` (one batch of logits per model in memory).

    Args:
        run_ref, run_cand: ``ids [b, seq] int64 -> logits [b, seq, vocab] float32``.
        windows: int64 ``[n, seq]`` (:func:`pipeline.models.text.token_windows`).
        batch: windows per call; progress: the stage's progress (``track``).
        label: the candidate's name in the progress line; context: as in :class:`QualityAccumulator`.
        acc: an empty accumulator to fill (the caller keeps its per-window sums); a new one when None.

    Returns:
        ``(perplexity_ref, perplexity_cand, statistics)``: the perplexities are
        ``exp(mean NLL)`` (inf when the candidate's sum is not finite), bit-identical
        to :func:`pipeline.models.text_generation.metrics.perplexity` run on each
        model alone; ``statistics`` is :meth:`QualityAccumulator.summary`.

    Raises:
        AccuracyError: NaN logits from the reference.
    """
    from pipeline.errors import AccuracyError

    acc = QualityAccumulator(context) if acc is None else acc
    for i in progress.track(list(range(0, len(windows), batch)), f"validate: perplexity (fp32 and {label})"):
        ids = windows[i : i + batch]
        ref = run_ref(ids)
        if np.isnan(ref).any():
            raise AccuracyError("validate: the FP32 reference produced NaN logits")
        acc.add(ref, run_cand(ids), ids)
    n = acc.tokens

    def ppl(total: float) -> float:
        return math.exp(total / n) if math.isfinite(total) else math.inf

    return ppl(acc.nll_sum_ref), ppl(acc.nll_sum_cand), acc.summary()
