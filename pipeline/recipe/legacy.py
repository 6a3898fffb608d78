"""Older recipe shapes, refused with their new form: renamed model kinds, the flat ``gates``
mapping, ``dataset`` + ``split`` and ``metric`` (the schema, :mod:`pipeline.recipe.schema`, calls
:func:`refuse_old_fields` before validating a section; the loader names an old gate field's
replacement)."""
from __future__ import annotations

from collections.abc import Sequence

import yaml

from pipeline.recipe.problems import ConstraintErrors, Problem

#: Kind names of older recipes -> their new name (refused, with the new form in the message).
RENAMED_KINDS = {"causal-lm": "text-generation", "encoder": "sentence-embedding"}


def _flow(value: object) -> str:
    """``value`` as one line of YAML flow style, keys in their given order."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 20).strip()


def refuse_old_fields(data: object, at: tuple[str, ...], fields: Sequence[str]) -> object:
    """A section mapping of an older recipe shape fails here, each old field with its
    new form (``dataset`` + ``split`` -> ``data``, flat ``gates``, ``metric``).

    Raises:
        ConstraintErrors: (loc, message) per old field found, ``loc`` from the recipe root.
    """
    if not isinstance(data, dict):
        return data
    problems: list[Problem] = []
    old = [k for k in ("dataset", "split") if k in data and k in fields]
    if old:
        new: dict = {"type": "corpus", "name": data.get("dataset", "lee_background")}
        if isinstance(data.get("split"), dict):
            new["split"] = data["split"]
        problems.append(((*at, old[0]), f"{' and '.join(old)} were replaced by a data source (types corpus, text, "
                         f"jsonl, pairs, images, npz); write data: {_flow(new)}"))
    if "metric" in fields and "metric" in data:
        problems.append(((*at, "metric"), "removed: it was never read (the model kind decides what validate "
                         "measures); delete it"))
    if "gates" in fields and isinstance(data.get("gates"), dict):
        problems.append(((*at, "gates"), f"flat gate fields were replaced by a list of {{metric: <name>, max: <x>}} "
                         f"or {{metric: <name>, min: <x>}}; write gates: {_flow(_gate_list(data['gates']))}"))
    if problems:
        raise ConstraintErrors(problems)
    return data


#: Flat gate fields of older recipes -> (metric, bound) of the gate that replaces each.
OLD_GATE_FIELDS = {
    "max_relative_perplexity_increase": ("relative_perplexity_increase", "max"),
    "min_token_agreement": ("token_agreement", "min"),
    "max_spearman_drop": ("spearman_drop_max", "max"),
    "min_mean_cosine": ("mean_cosine", "min"),
}


def _gate_list(flat: dict) -> list[dict]:
    """The gate list equivalent to an older recipe's flat ``gates`` mapping (unknown fields skipped)."""
    out = []
    for field, value in flat.items():
        if field in OLD_GATE_FIELDS and value is not None:
            metric, bound = OLD_GATE_FIELDS[field]
            out.append({"metric": metric, bound: value})
    return out
