"""``quantize.accuracy_budget``: automatic mixed precision that meets a budget or fails.

1. Measure every group's sensitivity on the tuning split (:mod:`pipeline.quant.sensitivity`;
   the ranking pass uses the first half of the tuning windows, the budget is judged on all).
2. Start from everything quantized; revert groups to high precision, most sensitive
   first, until the budget holds on the tuning split (a group whose reverting would
   take the quantized fraction below ``tuning.min_quantized_fraction`` is skipped).
3. Step back: re-quantize each reverted group, last reverted first, and keep it
   quantized if the budget still holds.
4. With ``sensitivity.refine``, instead of 2-3: GEMM by GEMM (:func:`search_fine`). Each GEMM's
   gain is predicted from one trial per projection and one per block (:mod:`pipeline.quant.proxy`);
   a few full trials bracket how many of the top-ranked GEMMs stay in high precision (at most
   :data:`FULL_TRIALS`).

Float noise: the search estimates the trial metric's float-kernel noise once
(:func:`pipeline.quant.sensitivity.thread_noise`) and sets a :class:`Tolerance` well above it.
Values within the tolerance are ties broken by name, and a trial within it of the bound misses,
so kernel differences between CPUs cannot flip a ranking or a verdict unless they exceed it.

The budget is a :class:`pipeline.recipe.schema.Gate` on a trial metric (``kld_mean``,
``relative_perplexity_increase``, ``top1_agreement``). Margin: the budget applies
to the *tuning* split and the validate gate to another split, so a recipe sets
the budget tighter than its gate. On a small tuning split prefer ``kld_mean``:
perplexity over ~1000 tokens is noise-dominated (fp8-llm: single-block trials
spread +0.6 % .. +2.9 % around +1.6 %), KL is not, and it transfers: fp8-llm's pinned set
measured tuning KL 0.0206 and validate KL 0.0195 (see its recipe). The search is bounded by ``tuning.max_trials`` and
``tuning.time_limit_s``; a search stopped by them says ``limit reached``.
An unreachable budget raises :class:`GateFailed` (exit 1) naming the best
configuration found and its numbers; its graph is kept as ``budget_best.onnx``. A search
stopped by a limit also exits 1, even when the configuration it reached meets the budget:
that configuration depends on the machine's speed (where the limit fell), so it is offered as
``budget_snippet.yaml`` to pin, never shipped or cached.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
import yaml

from pipeline import onnx_io
from pipeline.recipe import gates as gate_eval
from pipeline.errors import GateFailed
from pipeline.quant import qdq, sensitivity as S


@dataclass
class BudgetResult:
    """The outcome: ``excluded_groups`` / ``excluded_nodes`` (module scopes) left in
    high precision, the chosen trial's metrics, every trial, and the status
    (``met``, ``limit reached``, ``unreachable``)."""

    status: str
    metric: str
    bound: str
    excluded_groups: list[str]
    excluded_scopes: list[str]
    quantized_fraction: float
    metrics: dict[str, float]
    trials: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tolerance: dict = field(default_factory=dict)  # {value, noise}: see Tolerance

    def snippet(self, forced: list[str]) -> str:
        """A ready recipe snippet (YAML) that pins this result without a search:
        the recipe's own exclusions plus the found scopes, and no budget."""
        return yaml.safe_dump({"quantize": {"exclude": {"nodes": [*forced, *self.excluded_scopes]}}},
                              sort_keys=False)

    def to_json(self) -> dict:
        return asdict(self)

    def outcome(self) -> str:
        """One line: what the search chose and its metric on the tuning split."""
        kept = (f"{len(self.excluded_scopes)} GEMMs kept in high precision" if self.excluded_scopes
                else "the all-quantized trial, nothing kept in high precision")
        return (f"{kept}, {self.metric} = {self.metrics[self.metric]:.5g} ({self.bound}; "
                f"{self.quantized_fraction:.1%} of GEMMs quantized)")


def passes(budget, metrics: dict[str, float], tol: float = 0.0) -> bool:
    """Whether ``metrics`` meet the budget gate (:func:`pipeline.recipe.gates.evaluate`) by at least
    ``tol`` (metric units): a value within ``tol`` of the bound counts as a miss, conservatively."""
    if not gate_eval.evaluate([budget], metrics)[0].passed:
        return False
    v = metrics[budget.metric]
    return (budget.max - v if budget.max is not None else v - budget.min) >= tol


#: the tolerance is this many times the measured float-kernel noise ...
NOISE_FACTOR = 10.0
#: ... and at least this fraction of the bound (kernels of another CPU differ more than threads do)
TOL_FLOOR = 0.01
#: ranking ties: at least this fraction of the bound (far below any real difference between GEMMs)
TIE_FLOOR = 1e-4


@dataclass(frozen=True)
class Tolerance:
    """Float-kernel noise of a trial metric and the tolerances derived from it (metric units).

    ``value = max(NOISE_FACTOR * noise, TOL_FLOOR * |bound|)``: a trial within ``value`` of the
    bound misses. ``tie = max(NOISE_FACTOR * noise, TIE_FLOOR * |bound|)``: two gains closer than
    ``tie`` are a tie in a ranking, broken by name (:func:`rank`). The ranking's threshold follows
    the noise, not the bound: a coarse one would merge real differences and rank them by name."""

    value: float
    noise: float
    tie: float = 0.0

    @classmethod
    def of(cls, budget, noise: float) -> "Tolerance":
        bound = abs(float(budget.max if budget.max is not None else budget.min))
        floor = NOISE_FACTOR * abs(noise)
        return cls(max(floor, TOL_FLOOR * bound), abs(noise), max(floor, TIE_FLOOR * bound))


def rank(values: dict[str, float], tol: float) -> list[str]:
    """Names by value, largest first; a run of values each within ``tol`` of the next is a tie,
    ordered by name, so float noise below ``tol`` cannot reorder it."""
    order = sorted(values, key=lambda n: (-values[n], n))
    out: list[str] = []
    run: list[str] = []
    for n in order:
        if run and values[run[-1]] - values[n] >= tol:
            out += sorted(run)
            run = []
        run.append(n)
    return out + sorted(run)


#: full trials of the fine search's bracket (after the all-quantized one)
FULL_TRIALS = 8


class _Trials:
    """Counts a search's trials against ``max_trials`` / ``time_limit_s`` and prints progress."""

    def __init__(self, runner: S.TrialRunner, budget, max_trials: int, time_limit_s: float, expected: int,
                 say=None):
        self.runner, self.budget, self.max, self.limit, self.expected = runner, budget, max_trials, time_limit_s, expected
        self.start, self.used, self.say = time.perf_counter(), 0, say

    def limited(self) -> bool:
        return self.used >= self.max or time.perf_counter() - self.start >= self.limit

    def __call__(self, groups: list[str], batches: int | None = None) -> S.Trial:
        before = len(self.runner.trials)
        t = self.runner.measure(groups, batches)
        self.used += len(self.runner.trials) - before
        if self.say is not None and len(self.runner.trials) > before:  # a new trial, not one from memory
            left = self.limit - (time.perf_counter() - self.start)
            self.say(f"  trial {self.used} of ~{self.expected}: {t.excluded_nodes} GEMMs in high precision, "
                     f"{self.budget.metric} = {t.metrics[self.budget.metric]:.5g} ({t.windows} windows; "
                     f"{left:.0f} s left of the {self.limit:g} s limit)")
        return t


def search(runner: S.TrialRunner, sens: S.Sensitivity, budget, *, total_gemms: int, min_fraction: float,
           max_trials: int, time_limit_s: float, tol: Tolerance | None = None, say=None) -> BudgetResult:
    """Greedy revert of whole groups in sensitivity order, then step back (module docstring, steps 2-3).

    Args:
        runner: measures configurations; its trials made for ``sens`` count too.
        sens: the ranked groups.
        budget: a Gate on a trial metric.
        total_gemms: weight GEMMs of the graph (denominator of the quantized fraction),
            including those the recipe excludes itself.
        min_fraction: floor on quantized GEMMs / ``total_gemms``.
        max_trials, time_limit_s: search bounds (trials measured by this call).
        tol: float-noise tolerance (:class:`Tolerance`): ties in the ranking go by group name, and a
            trial within it of the bound misses. None: exact comparisons.
        say: progress line printer (``trial i of ~N``), or None.

    Returns:
        A :class:`BudgetResult`; ``status`` is ``unreachable`` when no configuration met the budget.
    """
    tv, tie = (tol.value, tol.tie) if tol else (0.0, 0.0)
    tr = _Trials(runner, budget, max_trials, time_limit_s, 2 * len(sens.rows) + 1, say)
    quantizable = len(runner.targets)

    def frac(groups: list[str]) -> float:
        return (quantizable - len(runner.nodes_of(groups))) / total_gemms

    order = rank({r["group"]: float(r["improvement"]) for r in sens.rows}, tie)
    excluded: list[str] = []
    best = current = tr(excluded)
    status = "met" if passes(budget, current.metrics, tv) else "unreachable"
    for g in order:
        if status == "met":
            break
        cand = [*excluded, g]
        if frac(cand) < min_fraction:
            continue
        if tr.limited():
            status = "limit reached"
            break
        current, excluded = tr(cand), cand
        if _better(budget, current.metrics, best.metrics, tv):
            best = current
        if passes(budget, current.metrics, tv):
            status = "met"
    if status != "met":
        return _result(runner, status, budget, best, frac(best.excluded_groups))
    for g in reversed(excluded[:]):  # step back
        if tr.limited():
            status = "limit reached"
            break
        cand = [x for x in excluded if x != g]
        if passes(budget, tr(cand).metrics, tv):
            excluded = cand
    return _result(runner, status, budget, runner.measure(excluded), frac(excluded))


def _better(budget, a: dict, b: dict, tol: float) -> bool:
    """``a`` beats ``b`` on the budget metric by more than ``tol``."""
    lower = budget.max is not None
    d = b[budget.metric] - a[budget.metric]
    return (d if lower else -d) > tol


def search_fine(runner: S.TrialRunner, gains: dict[str, float], budget, *, total_gemms: int, min_fraction: float,
                max_trials: int, time_limit_s: float, tol: Tolerance, full_trials: int = FULL_TRIALS,
                say=None) -> BudgetResult:
    """GEMM by GEMM, ranked by a proxy, bracketed by full trials.

    GEMMs are ranked by their predicted gain (:func:`pipeline.quant.proxy.predicted_gain`, ties
    within ``tol.tie`` by name). The predicted metric after reverting the top ``k`` is the
    all-quantized trial's minus the top ``k`` gains summed; the first full trial is at the smallest
    ``k`` predicted to meet the budget by ``tol``, then a bisection (or, while it misses, steps of
    half the count again) over ``k``, at most ``full_trials`` trials. The smallest ``k`` measured
    to meet the budget is chosen; since the trial count is fixed, not the time, the result does
    not depend on the machine's speed.

    Args:
        gains: per-GEMM group name (``runner`` groups of one node) -> predicted gain, metric units.
        Others: as :func:`search`.

    Returns:
        A :class:`BudgetResult` whose groups are single GEMMs (their module scopes).
    """
    tr = _Trials(runner, budget, max_trials, time_limit_s, full_trials + 1, say)
    order = rank(gains, tol.tie)
    lower = budget.max is not None
    base = tr([])
    if passes(budget, base.metrics, tol.value):
        return _result(runner, "met", budget, base, len(runner.targets) / total_gemms)
    kmax = max((k for k in range(len(order) + 1)
                if (len(runner.targets) - len(runner.nodes_of(order[:k]))) / total_gemms >= min_fraction), default=0)
    k = _predicted_k(base.metrics[budget.metric], [gains[g] for g in order[:kmax]], budget, tol.value, lower)
    lo, hi, best, used = 0, None, base, 0
    while used < full_trials and not tr.limited():
        t, used = tr(order[:k]), used + 1
        if passes(budget, t.metrics, tol.value):
            hi, best = k, t
        else:
            lo = k
            if hi is None and _better(budget, t.metrics, best.metrics, 0.0):
                best = t  # the closest miss, reported when nothing meets the budget
        if hi is None and k >= kmax:
            break
        if hi is not None and hi - lo <= 1:
            break
        k = (lo + hi) // 2 if hi is not None else min(kmax, k + max(2, k // 2))
    frac = (len(runner.targets) - len(runner.nodes_of(best.excluded_groups))) / total_gemms
    if hi is None:
        status = "limit reached" if tr.limited() else "unreachable"
        return _result(runner, status, budget, best, frac)
    res = _result(runner, "met", budget, best, frac)
    res.notes = [f"Fine search: {len(order)} GEMMs ranked by predicted gain (projection x block trials, "
                 f"pipeline/quant/proxy.py); {used} full trials bracket the count in high precision: {hi} meets "
                 f"the budget, {lo} does not" + (" (bracket not closed: trial cap)." if hi - lo > 1 else ".")
                 + f" Tolerance {tol.value:.3g} (noise {tol.noise:.3g})."]
    return res


def _predicted_k(base: float, gains: list[float], budget, tol: float, lower: bool) -> int:
    """Smallest ``k`` whose predicted metric meets the bound by ``tol`` (else ``len(gains)``)."""
    bound = budget.max if lower else budget.min
    value = base
    for k, g in enumerate(gains):
        if (bound - value if lower else value - bound) >= tol:
            return k
        value = value - g if lower else value + g
    return len(gains)


def _result(runner: S.TrialRunner, status: str, budget, chosen: S.Trial, fraction: float) -> BudgetResult:
    scopes_of = {t.node: (t.scope or t.node) for t in runner.targets}
    scopes = [scopes_of[n] for g in chosen.excluded_groups for n in runner.group_nodes[g]]
    bound = f"{budget.metric} {'<=' if budget.max is not None else '>='} {budget.max if budget.max is not None else budget.min}"
    trials = [{"excluded_groups": t.excluded_groups, "excluded_gemms": t.excluded_nodes, "windows": t.windows,
               **{k: round(v, 8) for k, v in t.metrics.items()}, "wall_s": round(t.wall_s, 2)} for t in runner.trials]
    return BudgetResult(status, budget.metric, bound, chosen.excluded_groups, scopes, fraction, chosen.metrics, trials)


def check_data(recipe) -> None:
    """Calibration, tuning and validate data must be pairwise disjoint.

    Raises:
        DataError: (exit 2) two uses overlap, naming both keys and ranges.
    """
    from pipeline.sources import data as datasets

    q = recipe.quantize
    datasets.check_disjoint({"quantize.calibration.data": q.calibration.data, "quantize.tuning.data": q.tuning.data,
                             "validate.data": recipe.validate_.data})


def reference_session(onnx_path: str):
    """The search's FP32 reference session: no weight prepacking and no memory arena (run once,
    then released; its GEMMs differ from a prepacking session's in the last bits, pin.SEARCH_VERSION 3)."""
    from pipeline.ort_sessions import ort_session

    return ort_session(onnx_path, prepack=False, arena=False)


def tune(q, feeds: list[dict], score, reference, model: onnx.ModelProto, targets: list[qdq.Target], forced: int,
         amax: dict[str, float], fmt: qdq.QFormat, *, weights_dir: str, out_dir: Path,
         progress) -> tuple[list[qdq.Target], BudgetResult | None, S.Sensitivity]:
    """Sensitivity and (with ``quantize.accuracy_budget``) the budget search. It never sees the stage:
    the caller hands it the tuning feeds and the scoring function (as NNCF's ``validation_fn``).

    Args:
        q: the recipe's ``quantize`` section (``tuning``, ``sensitivity``, ``accuracy_budget``).
        feeds: the tuning split's feed dicts (numpy arrays by graph input name), one per batch.
        score: ``(session, feeds) -> float32 [batch, seq, vocab]`` logits of one batch (the model kind's).
        reference: an ONNX Runtime session of the FP32 reference graph (:func:`reference_session`).
        model: the FP32 graph to quantize (smoothed if SmoothQuant is on); weights loaded or on disk.
        out_dir: where the reports go (the quantize stage's folder); ``progress``: its console.
        weights_dir: the folder ``model``'s on-disk weights refer to (the export's, or the
            quantize stage's once SmoothQuant saved the smoothed graph with external data).
        targets: GEMMs the recipe leaves quantizable; ``forced``: GEMMs it excludes itself.
        amax: per-tensor amax of every target's input.

    Returns:
        ``(targets to quantize, budget result or None, sensitivity)``; writes
        ``sensitivity.md``/``.png`` and ``budget.json``/``budget_snippet.yaml`` to the stage folder.

    Raises:
        GateFailed: the budget is unreachable within the floor and limits, or the search stopped
            at a limit (the message then says whether what it reached meets the budget).
    """
    tun = q.tuning
    grouping = q.sensitivity.groups if q.sensitivity else "per_block"
    runner = S.TrialRunner(model, targets, S.groups(targets, grouping), amax, fmt, q.per_channel_weights, feeds,
                           score, reference, weights_dir=weights_dir)
    metric = q.accuracy_budget.metric if q.accuracy_budget else "kld_mean"
    half = max(1, len(feeds) // 2)  # the ranking pass: half the windows (~40 % of the search's time saved)
    with progress.step(f"sensitivity: {len(runner.group_nodes)} groups ({grouping}) on {tun.data.describe()}"):
        sens = S.measure_sensitivity(runner, metric, half)
    S.write_report(sens, out_dir)
    if q.accuracy_budget is None:
        return targets, None, sens
    bounds = dict(total_gemms=len(targets) + forced, min_fraction=tun.min_quantized_fraction,
                  max_trials=tun.max_trials, time_limit_s=tun.time_limit_s, say=progress.print)
    with progress.step("float-kernel noise: the all-quantized trial at another thread count"):
        tol = Tolerance.of(q.accuracy_budget, S.thread_noise(runner, metric))
    if q.sensitivity and q.sensitivity.refine:
        with progress.step(f"proxy: one trial per block ({half} of {len(feeds)} tuning batches)"):
            gains = _fine_gains(runner, sens, half)
        with progress.step(f"accuracy budget: {q.accuracy_budget.metric}, GEMM by GEMM"):
            res = search_fine(runner, gains, q.accuracy_budget, tol=tol, **bounds)
    else:
        with progress.step(f"accuracy budget: {q.accuracy_budget.metric} on the tuning split"):
            res = search(runner, sens, q.accuracy_budget, tol=tol, **bounds)
    res.tolerance = {"value": tol.value, "tie": tol.tie, "noise": tol.noise}
    progress.print(f"  accuracy budget {res.status}: {res.outcome()}")
    _write(out_dir, res, list(q.exclude.nodes))
    if res.status != "met":
        weights = runner.weights_dir  # tensors not loaded into ``model`` are read from there
        best = qdq.insert_qdq(model, [t for t in targets if t.node not in _nodes(runner, res)], amax, fmt,
                              q.per_channel_weights, base_dir=weights)
        onnx_io.save_model_atomic(best, out_dir / "budget_best.onnx", base_dir=weights)
        if res.status == "limit reached" and passes(q.accuracy_budget, res.metrics):
            raise GateFailed(
                f"quantize.accuracy_budget: the search stopped at tuning.max_trials ({tun.max_trials}) or "
                f"tuning.time_limit_s ({tun.time_limit_s:g} s) before it finished. The configuration it had reached "
                f"meets {res.bound} on {tun.data.describe()} ({res.metric} = {res.metrics[res.metric]:.6g}, "
                f"{len(res.excluded_scopes)} GEMMs in high precision) but depends on where the limit fell, so it is "
                f"not used: raise the limit, or pin it with {out_dir / 'budget_snippet.yaml'} (graph "
                f"{out_dir / 'budget_best.onnx'}; trials in {out_dir / 'budget.md'})")
        raise GateFailed(
            f"quantize.accuracy_budget: {res.bound} not met on {tun.data.describe()} ({res.status}); best found: "
            f"{res.metric} = {res.metrics[res.metric]:.6g} with {len(res.excluded_scopes)} GEMMs in high precision "
            f"({res.quantized_fraction:.1%} quantized, floor {tun.min_quantized_fraction:.0%}), graph "
            f"{out_dir / 'budget_best.onnx'}; see {out_dir / 'budget.json'}")
    skip = _nodes(runner, res)
    return [t for t in targets if t.node not in skip], res, sens


def _fine_gains(runner: S.TrialRunner, sens: S.Sensitivity, batches: int | None) -> dict[str, float]:
    """Predicted gain per single-GEMM group (module scope), added to ``runner``'s groups
    (:mod:`pipeline.quant.proxy`): one trial per projection and one per block on the first
    ``batches`` tuning batches (those of ``sens`` are reused)."""
    from pipeline.quant import proxy

    gains = {grouping: _group_gains(runner, grouping, sens.metric, batches) for grouping in ("per_projection", "per_block")}
    runner.add_groups(S.groups(runner.targets, "per_gemm"))
    return proxy.predicted_gain(runner.targets, gains["per_projection"], gains["per_block"])


def _group_gains(runner: S.TrialRunner, grouping: str, metric: str, batches: int | None) -> dict[str, float]:
    """Group -> how much reverting it alone improves ``metric`` (trials already made are reused)."""
    groups = S.groups(runner.targets, grouping)
    runner.add_groups(groups)
    lower = S.TRIAL_METRICS[metric]
    base = runner.measure([], batches).metrics[metric]
    out = {}
    for g in groups:
        v = runner.measure([g], batches).metrics[metric]
        out[g] = (base - v) if lower else (v - base)
    return out


def _nodes(runner: S.TrialRunner, res: BudgetResult) -> set[str]:
    return runner.nodes_of(res.excluded_groups)


def _write(folder: Path, res: BudgetResult, forced: list[str]) -> None:
    import json

    (folder / "budget.json").write_text(json.dumps(res.to_json(), indent=1, default=float))
    (folder / "budget_snippet.yaml").write_text(res.snippet(forced))
    lines = [f"Accuracy budget `{res.bound}` on the tuning split: **{res.status}**; "
             f"{len(res.excluded_scopes)} GEMMs in high precision, {res.quantized_fraction:.1%} quantized.", "",
             "Each trial is shown as its change from the previous one (`+` left in high precision, `-` quantized "
             "again); `budget.json` lists every trial's full set. Trials with fewer windows are the sensitivity "
             "pass (ranking only); the budget is judged on all.", "",
             "| trial | change | GEMMs | windows | kld_mean | relative_perplexity_increase | top1_agreement | s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    prev: list[str] = []
    for i, t in enumerate(res.trials, 1):
        lines.append(f"| {i} | {_change(prev, t['excluded_groups'])} | {t['excluded_gemms']} | {t['windows']} | "
                     f"{t['kld_mean']:.4g} | {t['relative_perplexity_increase']:.4g} | {t['top1_agreement']:.4f} | "
                     f"{t['wall_s']} |")
        prev = t["excluded_groups"]
    tol = (f"Float noise {res.tolerance['noise']:.3g} (measured): a trial within {res.tolerance['value']:.3g} of the "
           f"bound misses; gains closer than {res.tolerance.get('tie', 0):.3g} are ties, broken by name."
           if res.tolerance else "")
    lines += ["", *res.notes, tol, "", *why_lines(res), "", "Recipe snippet (pins this result without a search):",
              "", "```yaml", res.snippet(forced), "```"]
    (folder / "budget.md").write_text("\n".join(lines) + "\n")


def _change(prev: list[str], now: list[str], shown: int = 3) -> str:
    """``+ a, - b`` from the set ``prev`` to ``now`` (at most ``shown`` names each way, then a count)."""
    if not prev and not now:
        return "(all quantized)"
    if not prev:
        return f"{len(now)} in high precision: " + _names(now, shown) if len(now) > 1 else f"+ {now[0]}"
    plus, minus = [g for g in now if g not in prev], [g for g in prev if g not in now]
    parts = ([f"+ {_names(plus, shown)}"] if plus else []) + ([f"- {_names(minus, shown)}"] if minus else [])
    return ", ".join(parts) or "(same set)"


def _names(names: list[str], shown: int) -> str:
    return ", ".join(names[:shown]) + (f" (+{len(names) - shown} more)" if len(names) > shown else "")


def why_lines(res: BudgetResult) -> list[str]:
    """Why the chosen groups stay in high precision: for each, the full-window trial with
    that one group quantized again and its budget metric (the step back measured them)."""
    chosen, full = set(res.excluded_groups), max((t["windows"] for t in res.trials), default=0)
    out = []
    for g in res.excluded_groups:
        without = [t for t in res.trials if set(t["excluded_groups"]) == chosen - {g} and t["windows"] == full]
        if without:
            out.append(f"- {g} quantized again: {res.metric} = {without[-1][res.metric]:.4g}, outside `{res.bound}`")
    if not out:
        return []
    return [f"Why these {len(res.excluded_groups)} group(s): with any one of them quantized again the budget is "
            "not met on the tuning split:", "", *out]
