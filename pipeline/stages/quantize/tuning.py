"""The quantize stage's side of the accuracy-budget search: the tuning feeds and the scoring function
:func:`pipeline.quant.budget.tune` takes (as NNCF's ``validation_fn``), so ``quant/`` never sees the stage."""
from __future__ import annotations



from pipeline.context import StageContext
from pipeline.errors import QuantizationError
from pipeline.models import registry
from pipeline.quant import budget



def score_logits(session, feeds: dict):
    """The causal LM's scoring function for the tuning search: float32 logits ``[batch, seq, vocab]``."""
    return session.run(["logits"], feeds)[0]

def tuning_feeds(ctx: StageContext, exp) -> list[dict]:
    """The tuning split as feed dicts (the model kind's calibration feeds, ``quantize.tuning.max_windows``
    windows), after checking it is disjoint from the calibration and validate data.

    Raises:
        DataError: the tuning data overlaps calibration or validate data (names both).
        QuantizationError: it gives no window of ``calibration.seq_len`` tokens.
    """
    q = ctx.recipe.quantize
    budget.check_data(ctx.recipe)
    cal = q.calibration.model_copy(update={"samples": q.tuning.max_windows, "min_samples": 1})
    feeds = registry.adapter(ctx.recipe.model).calibration_feeds(exp, q.tuning.data, cal)
    if not feeds:
        raise QuantizationError(f"quantize.tuning.data: {q.tuning.data.describe()} gives no window of {cal.seq_len} tokens")
    return feeds
