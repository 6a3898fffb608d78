"""``quantize.accuracy_budget``: automatic mixed precision that meets a budget or fails (issue 10 §3).

1. Measure every group's sensitivity on the tuning split (:mod:`pipeline.quant.sensitivity`;
   the ranking pass uses the first half of the tuning windows, the budget is judged on all).
2. Start from everything quantized; revert groups to high precision, most sensitive
   first, until the budget holds on the tuning split (a group whose reverting would
   take the quantized fraction below ``tuning.min_quantized_fraction`` is skipped).
3. Step back: re-quantize each reverted group, last reverted first, and keep it
   quantized if the budget still holds.
4. With ``sensitivity.refine``: split the groups still in high precision into single
   GEMMs, rank each by the metric with only it re-quantized (ranking windows), then
   re-quantize the cheapest: the longest prefix that meets the budget (binary search),
   then each next one alone, stopping after :data:`REFINE_PATIENCE` misses in a row.

The budget is a :class:`pipeline.recipe.Gate` on a trial metric (``kld_mean``,
``relative_perplexity_increase``, ``top1_agreement``). Margin: the budget applies
to the *tuning* split and the validate gate to another split, so a recipe sets
the budget tighter than its gate. On a small tuning split prefer ``kld_mean``:
perplexity over ~1000 tokens is noise-dominated (fp8-llm: single-block trials
spread +0.6 % .. +2.9 % around +1.6 %), KL is not; fp8-llm sets its ``kld_mean``
budget below the tuning KL of a configuration measured to pass its 0.010 perplexity
gate on validate (see its recipe). The search is bounded by ``tuning.max_trials`` and
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

from pipeline import gates as gate_eval
from pipeline.errors import GateFailed, QuantizationError
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

    def snippet(self, forced: list[str]) -> str:
        """A ready recipe snippet (YAML) that pins this result without a search:
        the recipe's own exclusions plus the found scopes, and no budget."""
        return yaml.safe_dump({"quantize": {"exclude": {"nodes": [*forced, *self.excluded_scopes]}}},
                              sort_keys=False)

    def to_json(self) -> dict:
        return asdict(self)


def passes(budget, metrics: dict[str, float]) -> bool:
    """Whether ``metrics`` meet the budget gate (:func:`pipeline.gates.evaluate`)."""
    return gate_eval.evaluate([budget], metrics)[0].passed


#: refinement: consecutive single-GEMM re-quantizations that miss the budget before it stops
REFINE_PATIENCE = 3


def search(runner: S.TrialRunner, sens: S.Sensitivity, budget, *, total_gemms: int, min_fraction: float,
           max_trials: int, time_limit_s: float, refine: bool = False, rank_batches: int | None = None
           ) -> BudgetResult:
    """Greedy revert in sensitivity order, then step back, then (``refine``) single GEMMs
    (module docstring).

    Args:
        runner: measures configurations; its trials made for ``sens`` count too.
        sens: the ranked groups.
        budget: a Gate on a trial metric.
        total_gemms: weight GEMMs of the graph (denominator of the quantized fraction),
            including those the recipe excludes itself.
        min_fraction: floor on quantized GEMMs / ``total_gemms``.
        max_trials, time_limit_s: search bounds (trials measured by this call).
        refine: split the kept groups into single GEMMs and re-quantize what the budget allows.
        rank_batches: tuning batches of the refinement's ranking trials (default: all).

    Returns:
        A :class:`BudgetResult`; ``status`` is ``unreachable`` when no configuration met the budget.
    """
    start, used = time.perf_counter(), 0
    quantizable = len(runner.targets)
    lower = budget.max is not None

    def frac(groups: list[str]) -> float:
        return (quantizable - len(runner.nodes_of(groups))) / total_gemms

    def limited() -> bool:
        return used >= max_trials or time.perf_counter() - start >= time_limit_s

    def trial(groups: list[str], batches: int | None = None) -> S.Trial:
        nonlocal used
        before = len(runner.trials)
        t = runner.measure(groups, batches)
        used += len(runner.trials) - before
        return t

    excluded: list[str] = []
    current = trial(excluded)
    best = current
    status = "met" if passes(budget, current.metrics) else "unreachable"
    for row in sens.rows:
        if status == "met":
            break
        cand = [*excluded, row["group"]]
        if frac(cand) < min_fraction:
            continue
        if limited():
            status = "limit reached"
            break
        current, excluded = trial(cand), cand
        value = current.metrics[budget.metric]
        if (value < best.metrics[budget.metric]) == lower:
            best = current
        if passes(budget, current.metrics):
            status = "met"
    if status != "met":
        status = status if status == "limit reached" else "unreachable"
        return _result(runner, status, budget, best, frac(best.excluded_groups))
    for g in reversed(excluded[:]):  # step back
        if limited():
            status = "limit reached"
            break
        cand = [x for x in excluded if x != g]
        t = trial(cand)
        if passes(budget, t.metrics):
            excluded, current = cand, t
    notes: list[str] = []
    if refine and status == "met":
        excluded, status, notes = _refine(runner, excluded, budget, trial, limited, rank_batches)
    met = runner.measure(excluded)
    res = _result(runner, status, budget, met, frac(excluded))
    res.notes = notes
    return res


def _refine(runner: S.TrialRunner, excluded: list[str], budget, trial, limited, rank_batches: int | None
            ) -> tuple[list[str], str, list[str]]:
    """Step 4 of the module docstring. Returns ``(groups in high precision, status, report notes)``."""
    kept_nodes = runner.nodes_of(excluded)
    fine: dict[str, list[str]] = {}
    for t in runner.targets:
        if t.node in kept_nodes:
            fine.setdefault(S.group_of(t, "per_gemm"), []).append(t.node)
    if len(fine) <= len(excluded):
        return excluded, "met", []
    runner.add_groups(fine)
    kept, lower = list(fine), budget.max is not None
    cost = {}
    for g in kept:
        if limited():
            return excluded, "limit reached", ["refinement: limit reached while ranking single GEMMs"]
        cost[g] = trial([x for x in kept if x != g], rank_batches).metrics[budget.metric]
    order = sorted(kept, key=lambda g: cost[g] if lower else -cost[g])
    lo, hi = 0, len(order)  # re-quantizing order[:lo] meets the budget; order[:hi] is taken not to
    while hi - lo > 1:
        if limited():
            return excluded, "limit reached", ["refinement: limit reached in the binary search"]
        mid = (lo + hi) // 2
        if passes(budget, trial([g for g in kept if g not in order[:mid]]).metrics):
            lo = mid
        else:
            hi = mid
    chosen, misses, status = [g for g in kept if g not in order[:lo]], 0, "met"
    for g in order[lo + 1:]:
        if misses >= REFINE_PATIENCE:
            break
        if limited():
            status = "limit reached"
            break
        cand = [x for x in chosen if x != g]
        if passes(budget, trial(cand).metrics):
            chosen, misses = cand, 0
        else:
            misses += 1
    notes = [f"Refinement: the {len(kept_nodes)} GEMMs of {', '.join(excluded)} ranked one by one "
             f"(each re-quantized alone); the cheapest {lo} re-quantized together (binary search), then one at a "
             f"time until {REFINE_PATIENCE} misses in a row: {len(chosen)} single GEMMs stay in high precision"
             + (" (limit reached before the end)." if status != "met" else ".")]
    return chosen, status, notes


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
    from pipeline import datasets

    q = recipe.quantize
    datasets.check_disjoint({"quantize.calibration.data": q.calibration.data, "quantize.tuning.data": q.tuning.data,
                             "validate.data": recipe.validate_.data})


def tune(ctx, exp, model: onnx.ModelProto, targets: list[qdq.Target], forced: int, amax: dict[str, float],
         fmt: qdq.QFormat, *, calibration_feeds) -> tuple[list[qdq.Target], BudgetResult | None, S.Sensitivity]:
    """Sensitivity and (with ``quantize.accuracy_budget``) the budget search for the quantize stage.

    Args:
        ctx: the quantize stage context (``recipe.quantize.tuning``, ``sensitivity``, ``accuracy_budget``).
        exp: the export artifact (tokenizer, FP32 reference graph).
        model: the FP32 graph to quantize (smoothed if SmoothQuant is on), weights loaded.
        targets: GEMMs the recipe leaves quantizable; ``forced``: GEMMs it excludes itself.
        amax: per-tensor amax of every target's input.
        calibration_feeds: ``(exp, data source, calibration config) -> list of feed dicts``, the
            model kind's :meth:`pipeline.models.base.ModelAdapter.calibration_feeds` (the stage passes it).

    Returns:
        ``(targets to quantize, budget result or None, sensitivity)``; writes
        ``sensitivity.md``/``.png`` and ``budget.json``/``budget_snippet.yaml`` to the stage folder.

    Raises:
        DataError: tuning data overlaps calibration or validate data, or gives no window.
        GateFailed: the budget is unreachable within the floor and limits, or the search stopped
            at a limit (the message then says whether what it reached meets the budget).
    """
    from pipeline.runtime import ort_session

    q = ctx.recipe.quantize
    check_data(ctx.recipe)
    tun = q.tuning
    cal = q.calibration.model_copy(update={"samples": tun.max_windows, "min_samples": 1})
    feeds = calibration_feeds(exp, tun.data, cal)
    if not feeds:
        raise QuantizationError(f"quantize.tuning.data: {tun.data.describe()} gives no window of {cal.seq_len} tokens")
    grouping = q.sensitivity.groups if q.sensitivity else "per_block"
    runner = S.TrialRunner(model, targets, S.groups(targets, grouping), amax, fmt, q.per_channel_weights, feeds,
                           lambda sess, f: sess.run(["logits"], f)[0], ort_session(exp.onnx_path))
    metric = q.accuracy_budget.metric if q.accuracy_budget else "kld_mean"
    half = max(1, len(feeds) // 2)  # the ranking pass: half the windows (~40 % of the search's time saved)
    with ctx.progress.step(f"sensitivity: {len(runner.group_nodes)} groups ({grouping}) on {tun.data.describe()}"):
        sens = S.measure_sensitivity(runner, metric, half)
    S.write_report(sens, ctx.stage_dir)
    if q.accuracy_budget is None:
        return targets, None, sens
    total = len(targets) + forced
    with ctx.progress.step(f"accuracy budget: {q.accuracy_budget.metric} on the tuning split"):
        res = search(runner, sens, q.accuracy_budget, total_gemms=total, min_fraction=tun.min_quantized_fraction,
                     max_trials=tun.max_trials, time_limit_s=tun.time_limit_s,
                     refine=bool(q.sensitivity and q.sensitivity.refine), rank_batches=half)
    _write(ctx.stage_dir, res, list(q.exclude.nodes))
    if res.status != "met":
        best = qdq.insert_qdq(model, [t for t in targets if t.node not in _nodes(runner, res)], amax, fmt,
                              q.per_channel_weights)
        onnx.save(best, str(ctx.stage_dir / "budget_best.onnx"))
        if res.status == "limit reached" and passes(q.accuracy_budget, res.metrics):
            raise GateFailed(
                f"quantize.accuracy_budget: the search stopped at tuning.max_trials ({tun.max_trials}) or "
                f"tuning.time_limit_s ({tun.time_limit_s:g} s) before it finished. The configuration it had reached "
                f"meets {res.bound} on {tun.data.describe()} ({res.metric} = {res.metrics[res.metric]:.6g}, "
                f"{len(res.excluded_scopes)} GEMMs in high precision) but depends on where the limit fell, so it is "
                f"not used: raise the limit, or pin it with {ctx.stage_dir / 'budget_snippet.yaml'} (graph "
                f"{ctx.stage_dir / 'budget_best.onnx'}; trials in {ctx.stage_dir / 'budget.md'})")
        raise GateFailed(
            f"quantize.accuracy_budget: {res.bound} not met on {tun.data.describe()} ({res.status}); best found: "
            f"{res.metric} = {res.metrics[res.metric]:.6g} with {len(res.excluded_scopes)} GEMMs in high precision "
            f"({res.quantized_fraction:.1%} quantized, floor {tun.min_quantized_fraction:.0%}), graph "
            f"{ctx.stage_dir / 'budget_best.onnx'}; see {ctx.stage_dir / 'budget.json'}")
    skip = _nodes(runner, res)
    return [t for t in targets if t.node not in skip], res, sens


def _nodes(runner: S.TrialRunner, res: BudgetResult) -> set[str]:
    return runner.nodes_of(res.excluded_groups)


def _write(folder: Path, res: BudgetResult, forced: list[str]) -> None:
    import json

    (folder / "budget.json").write_text(json.dumps(res.to_json(), indent=1, default=float))
    (folder / "budget_snippet.yaml").write_text(res.snippet(forced))
    lines = [f"Accuracy budget `{res.bound}` on the tuning split: **{res.status}**; "
             f"{len(res.excluded_scopes)} GEMMs in high precision, {res.quantized_fraction:.1%} quantized.", "",
             "Trials marked with fewer windows are the sensitivity pass (ranking only); the budget is judged on all.", "",
             "| trial | groups in high precision | GEMMs | windows | kld_mean | relative_perplexity_increase | "
             "top1_agreement | s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {i} | {', '.join(t['excluded_groups']) or '(none)'} | {t['excluded_gemms']} | {t['windows']} | "
              f"{t['kld_mean']:.4g} | "
              f"{t['relative_perplexity_increase']:.4g} | {t['top1_agreement']:.4f} | {t['wall_s']} |"
              for i, t in enumerate(res.trials, 1)]
    lines += ["", *res.notes, "", *why_lines(res), "", "Recipe snippet (pins this result without a search):", "", "```yaml",
              res.snippet(forced), "```"]
    (folder / "budget.md").write_text("\n".join(lines) + "\n")


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
