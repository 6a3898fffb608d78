"""Pinned tuning results: the calibration and accuracy-budget outcome as a lock file.

``python -m pipeline tune recipes/<r>.yaml`` (``make tune RECIPE=<r>`` for this checkout's recipes) calibrates, runs the
sensitivity pass and the budget search, and writes ``recipes/tuned/<r>.json`` beside the recipe
(outside the ``recipes/*.yaml`` glob). ``build`` then uses that file when it matches, and runs
neither calibration nor the search: the graph it quantizes is the same on every runner, whatever
its CPU kernels (one float32 ulp in an FP8 scale moves perplexity measurably).

A pin holds:

* ``excluded``: module scopes (or node names) left in high precision, besides ``quantize.exclude``;
* ``amax``: per-tensor activation amax of every quantized GEMM input (the calibration result),
  keyed by the exporter's tensor names (``mul_107``);
* ``consumers``: for each ``amax`` tensor, the weight GEMMs that read it in the graph it was tuned
  on (module scopes, node names where the exporter gave none): the build checks them against the
  exported graph, so an exporter that renumbers its tensors cannot put a scale on another tensor
  (pins written before it have none, and are applied unchecked, saying so);
* ``channel_amax``: SmoothQuant's per-channel input amax (float32, little endian, base64), if used;
* ``metrics``: what the search reached on the tuning split;
* ``match``: what it must match (:func:`match_fields`), and ``recorded``: what it only records
  (tool versions, CPU, date). It never matches on the package's source hash, so a refactor keeps
  every pin; :data:`SEARCH_VERSION` is bumped by hand when the search or calibration changes meaning.

:func:`read` validates the file like any input (:class:`PinFile`: types, finite positive amax, a
known ``format``); the quantize stage applies the recipe's own bounds to what the pin adds
(:func:`check_consumers`, and ``pipeline.stages.quantize``: at least one GEMM left quantized,
``tuning.min_quantized_fraction``). Every refusal is exit 2 naming the file and the JSON path.
"""
from __future__ import annotations

import base64
import datetime
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from pipeline.errors import QuantizationError, RecipeError

#: bump when pipeline/quant/budget.py, sensitivity.py or calibrate.py change what a search or a
#: calibration produces for the same inputs (every pin is then stale and says so). 3: the FP32
#: reference session runs without weight prepacking (its GEMMs differ in the last bits). 4: the
#: clip search (calibration ``mse``/``kl``, ``weight_clip``) and the transforms in ``match``
SEARCH_VERSION = 4
FORMAT = 1
#: what `make build` prints and the report shows for each way the quantize stage got its result
PINNED, SEARCHED = "pinned", "searched"
#: the quantize stage's candidate pin, written after every calibration; `tune` copies it
CANDIDATE = "tuned.json"


def pin_path(recipe_path: str | Path, name: str) -> Path:
    """``<recipe folder>/tuned/<recipe name>.json``."""
    return Path(recipe_path).parent / "tuned" / f"{name}.json"


def tune_command(recipe_path: str | Path) -> str:
    """The command that (re-)writes the pin of the recipe at ``recipe_path`` (as the user gave it):
    ``make tune RECIPE=<r>`` works only for ``recipes/<r>.yaml`` of this checkout, this one for any."""
    return f"python -m pipeline tune {recipe_path}"


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


#: quantize fields added after pins were written -> their default (left out of the digest at it;
#: the schema also drops the later ones from its dumps at their default, so stage keys keep too)
_ADDED_FIELDS = {"reduce_range": False, "weight_clip": "max", "rotate": False}


def transforms(q) -> str:
    """What the quantize section does to the graph before and around Q/DQ, as the pin records it in
    ``match`` (``clip:max,wclip:max`` for a plain calibration; ``smooth:alpha0.5`` / ``smooth:search``,
    ``rotate:r1r2``): a stale pin's message names the method it was made with."""
    parts = []
    if q.calibration is not None:
        parts.append(f"clip:{q.calibration.method}")
    if getattr(q, "weight_clip", None) is not None and q.calibration is not None:
        parts.append(f"wclip:{q.weight_clip}")
    sq = q.smoothquant
    if sq is not None:
        parts.append("smooth:search" if getattr(sq, "mode", "alpha") == "search" else f"smooth:alpha{sq.alpha:g}")
    if getattr(q, "rotate", False):
        parts.append("rotate:r1r2")
    return ",".join(parts) or "none"


def match_fields(recipe, inputs: dict[str, dict[str, str]]) -> dict[str, str | int]:
    """What a pin must match: the search version, the sha256 of the model file, the calibration
    and tuning data (``inputs`` is the manifest's ``inputs``), and of the ``quantize`` section
    without ``exclude.nodes`` (a pinned search's output, and where a snippet would go) and without
    the search bounds ``tuning.max_trials`` / ``tuning.time_limit_s`` (a finished search does not
    depend on them). A field of :data:`_ADDED_FIELDS` at its default is left out too, so adding
    a field does not make every pin stale."""
    q = recipe.quantize.model_dump(mode="json")
    q.get("exclude", {}).pop("nodes", None)
    for k, default in _ADDED_FIELDS.items():  # at its default, a field added later keeps older pins
        if q.get(k) == default:
            q.pop(k)
    for k in ("max_trials", "time_limit_s"):
        (q.get("tuning") or {}).pop(k, None)
    fields: dict[str, str | int] = {"search_version": SEARCH_VERSION, "quantize": _digest(q),
                                    "transforms": transforms(recipe.quantize),
                                    "model": inputs.get("model_file", {}).get("sha256", "")}
    for use in ("quantize.calibration.data", "quantize.tuning.data"):
        if use in inputs:
            fields[use] = inputs[use]["sha256"]
    return fields


@dataclass(frozen=True)
class PinLookup:
    """The quantize stage's view of the pin: ``pinned`` (the file's content) when it matches,
    else ``None`` and ``reason`` (which input changed, or that there is none)."""

    path: Path
    fields: dict
    pinned: dict | None = None
    reason: str = ""
    recorded: dict = field(default_factory=dict)

    def key(self) -> str:
        """The quantize stage key's share: the pin's content, or ``search``."""
        return _digest(self.pinned) if self.pinned is not None else "search"

    def describe(self, root: Path | None = None) -> str:
        where = _rel(self.path, root)
        return f"pinned tuning result {where}" if self.pinned is not None else f"no pinned result used: {self.reason}"


def _rel(path: Path, root: Path | None) -> str:
    try:
        return str(path.resolve().relative_to((root or Path.cwd()).resolve()))
    except ValueError:
        return str(path)


#: why ``tune`` never uses a pin (:func:`lookup`'s ``ignore``)
TUNE_IGNORES = "`tune` runs calibration and the search anew"


def lookup(recipe, recipe_path: str | Path, inputs: dict, *, ignore: str = "") -> PinLookup:
    """Read the recipe's pin and check it against :func:`match_fields`.

    Args:
        ignore: why no pin applies to this run (``tune``: :data:`TUNE_IGNORES`; ``build --test``:
            a random copy); non-empty: the pin is not read and calibration and the search run.

    Raises:
        RecipeError: (exit 2) the pin file exists but is not a valid pin (names the file).
    """
    path = pin_path(recipe_path, recipe.name)
    fields = match_fields(recipe, inputs)
    if ignore:
        return PinLookup(path, fields, reason=ignore)
    if not path.is_file():
        return PinLookup(path, fields, reason=f"{path} does not exist ({tune_command(recipe_path)} writes it)")
    pin = read(path, retune=tune_command(recipe_path))
    changed = [k for k in sorted(set(fields) | set(pin["match"])) if pin["match"].get(k) != fields.get(k)]
    if changed:
        made = pin["match"].get("transforms") or (f"search version {pin['match'].get('search_version', '?')}, "
                                                  "before transforms were recorded")
        return PinLookup(path, fields, reason=f"{path} is stale: {', '.join(_what(k) for k in changed)} changed "
                                              f"since it was tuned (made with {made}; this recipe: "
                                              f"{fields['transforms']}, search version {SEARCH_VERSION}; "
                                              f"{tune_command(recipe_path)} re-tunes)")
    return PinLookup(path, fields, pinned=pin)


_WHAT = {"search_version": "the search/calibration code (SEARCH_VERSION)", "model": "the model file",
         "quantize": "the quantize section", "transforms": "the transforms"}


def _what(key: str) -> str:
    return _WHAT.get(key, key)


def _channel_amax(text: str) -> str:
    """A ``channel_amax`` value: base64 of float32 little-endian values, each finite and >= 0."""
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise ValueError("not base64") from None
    if not raw or len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes: not a whole, non-empty number of float32 values")
    values = np.frombuffer(raw, "<f4")
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    if bad.size:
        raise ValueError(f"channel {int(bad[0])} is {float(values[bad[0]])!r} ({bad.size} such)")
    return text


def _known_format(value: int) -> int:
    if value != FORMAT:
        raise ValueError("not a format this version reads (a newer pipeline wrote it, or it was edited)")
    return value


NonEmpty = Annotated[str, Field(min_length=1)]


class PinFile(BaseModel):
    """The schema of a pin file (strict: no coercion, no unknown key). :func:`read` applies it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Annotated[int, AfterValidator(_known_format)] = Field(description="the pin file's format (:data:`FORMAT`)")
    match: dict[NonEmpty, str | int] = Field(description="what it must match (:func:`match_fields`)")
    excluded: list[NonEmpty] = Field(description="module scopes or node names left in high precision")
    amax: dict[NonEmpty, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        description="activation tensor -> calibrated abs-max")
    consumers: dict[NonEmpty, list[NonEmpty]] | None = Field(
        None, description="activation tensor -> the GEMMs reading it (scopes); absent in pins written before it")
    channel_amax: dict[NonEmpty, Annotated[str, AfterValidator(_channel_amax)]] = Field(
        default_factory=dict, description="SmoothQuant's per-channel amax, float32 base64")
    metrics: dict[NonEmpty, float] = Field(default_factory=dict, description="what the search reached")
    search: dict[str, Any] = Field(default_factory=dict, description="how the search ended (recorded only)")
    recorded: dict[str, Any] = Field(default_factory=dict, description="versions, CPU, date (recorded only)")


#: what a valid value is, by top-level key (the refusal's "valid: ...")
_VALID = {"format": f"{FORMAT}", "match": "an object of strings and integers (written by tune)",
          "excluded": "a list of module scopes or node names", "amax": "a finite number > 0",
          "consumers": "an object: amax tensor -> list of GEMM scopes",
          "channel_amax": "base64 of float32 values, each finite and >= 0",
          "metrics": "an object of numbers", "search": "an object", "recorded": "an object"}


def json_path(loc: tuple) -> str:
    """``("amax", "mul_7")`` -> ``amax["mul_7"]``; ``("excluded", 3)`` -> ``excluded[3]``."""
    if not loc:
        return "<root>"
    head, *rest = loc
    return str(head) + "".join(f"[{k}]" if isinstance(k, int) else f"[{json.dumps(k)}]" for k in rest)


def _problem(err: ErrorDetails) -> str:
    """One line of :func:`read`'s refusal: the JSON path, what is wrong, the value given and what is valid."""
    loc = tuple(err["loc"])
    top = str(loc[0]) if loc else ""
    if err["type"] == "extra_forbidden":
        return f"{json_path(loc)}: unknown key; valid keys: {', '.join(PinFile.model_fields)}"
    if err["type"] == "missing":
        return f"{json_path(loc)}: missing"
    msg = err["msg"].removeprefix("Value error, ")
    valid = _VALID.get(top, "")
    got = err.get("input")
    return f"{json_path(loc)}: {msg}, got {json.dumps(got) if _jsonable(got) else repr(got)}" + (
        f"; valid: {valid}" if valid and valid not in msg else "")


def _jsonable(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return len(json.dumps(value)) <= 80


def read(path: Path, retune: str = "python -m pipeline tune <recipe>") -> dict:
    """A pin file's content, validated (:class:`PinFile`); ``retune``: the command the errors give
    (:func:`tune_command`).

    Raises:
        RecipeError: (exit 2) not JSON, or not a valid pin: a key missing or unknown, a value of the
            wrong type (``true`` or ``"1.0"`` for a number), an amax that is not finite and > 0, an
            unknown ``format``, ``consumers`` or ``channel_amax`` naming a tensor ``amax`` lacks.
            The message names the file and each failing key as a JSON path (``amax["mul_107"]``).
    """
    try:
        pin = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RecipeError(f"{path}: not a readable pinned tuning result ({e}); re-create it with {retune}") from None
    if not isinstance(pin, dict):
        raise RecipeError(f"{path}: a pinned tuning result is a JSON object, not {type(pin).__name__}; "
                          f"re-create it with {retune}")
    try:
        PinFile.model_validate(pin)
    except ValidationError as e:
        problems = [_problem(err) for err in e.errors()]
        raise RecipeError(f"{path}: not a valid pinned tuning result; re-create it with {retune}:\n  "
                          + "\n  ".join(problems)) from None
    problems = [f"{json_path((key, act))}: no amax[{json.dumps(act)}] for it"
                for key in ("consumers", "channel_amax") for act in (pin.get(key) or {}) if act not in pin["amax"]]
    if pin.get("consumers") is not None:
        lacking = [act for act in pin["amax"] if act not in pin["consumers"]]
        if lacking:
            problems.append(f"consumers: no entry for {len(lacking)} amax tensors: "
                            + ", ".join(json.dumps(a) for a in lacking[:5]) + (", ..." if len(lacking) > 5 else ""))
    if problems:
        raise RecipeError(f"{path}: not a valid pinned tuning result; re-create it with {retune}:\n  "
                          + "\n  ".join(problems))
    return pin


def candidate(fields: dict, *, excluded: list[str], amax: dict[str, float], consumers: dict[str, list[str]],
              channel_amax: dict[str, np.ndarray], metrics: dict, search: dict, recorded: dict) -> dict:
    """The pin's content (the quantize stage writes it as ``quantize/tuned.json``).

    ``amax`` values are kept exactly (JSON floats round-trip float64); ``consumers``: of each
    ``amax`` tensor (:func:`graph_consumers`); ``channel_amax`` as float32 bytes, base64."""
    return {"format": FORMAT, "match": fields, "excluded": list(excluded),
            "amax": {k: float(v) for k, v in sorted(amax.items())},
            "consumers": {k: list(consumers[k]) for k in sorted(amax)},
            "channel_amax": {k: base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
                             for k, v in sorted(channel_amax.items())},
            "metrics": metrics, "search": search,
            "recorded": {**recorded, "date": datetime.date.today().isoformat()}}


def channel_amax(pin: dict) -> dict[str, np.ndarray]:
    """SmoothQuant's pinned per-channel amax, float32 ``[channels]`` per activation."""
    return {k: np.frombuffer(base64.b64decode(v), "<f4").copy() for k, v in pin.get("channel_amax", {}).items()}


def graph_consumers(targets, acts) -> dict[str, list[str]]:
    """Of each tensor in ``acts``: the sorted module scopes (node name where a GEMM has none) of
    the weight GEMMs in ``targets`` (:class:`pipeline.quant.qdq.Target`) that read it; ``[]`` when none does."""
    out: dict[str, list[str]] = {a: [] for a in acts}
    for t in targets:
        if t.act in out:
            out[t.act].append(t.scope or t.node)
    return {a: sorted(v) for a, v in out.items()}


def check_consumers(pinned: dict, targets, path: Path, retune: str) -> bool:
    """Whether the pin's amax are bound to the exported graph: its ``consumers`` (when it has them)
    must be the GEMMs that read each ``amax`` tensor in ``targets`` (all the graph's weight GEMMs).

    Returns:
        True when checked; False for a pin written before ``consumers`` (applied by name, unchecked).

    Raises:
        QuantizationError: (exit 2) a tensor feeds other GEMMs in the exported graph, or none (the
            exporter renamed or renumbered its tensors since the pin was tuned); names the file,
            the key and both sets of GEMMs.
    """
    if pinned.get("consumers") is None:
        return False
    found = graph_consumers(targets, pinned["amax"])
    moved = [a for a in sorted(pinned["amax"]) if found[a] != sorted(pinned["consumers"][a])]
    if moved:
        a = moved[0]
        raise QuantizationError(
            f"{path}: consumers[{json.dumps(a)}]: the pin's amax[{json.dumps(a)}] was tuned for "
            f"{_gemms(pinned['consumers'][a])}, but in the exported graph {a!r} feeds {_gemms(found[a])} "
            f"({len(moved)} of {len(found)} amax tensors differ): the exporter named its tensors otherwise "
            f"(e.g. another torch version), so the pinned scales would go to other tensors; re-tune ({retune})")
    return True


def _gemms(scopes: list[str]) -> str:
    if not scopes:
        return "no weight GEMM"
    return ", ".join(scopes[:3]) + (f" and {len(scopes) - 3} more" if len(scopes) > 3 else "")


def check_locked(recipe, found: PinLookup) -> None:
    """``build --locked``: a recipe whose quantize stage would search needs a matching pin.

    Raises:
        RecipeError: (exit 2) no pin, or a stale one, saying which input changed.
    """
    if recipe.quantize.accuracy_budget is not None and found.pinned is None:
        raise RecipeError(f"--locked: quantize.accuracy_budget would run a search, and {found.reason}")
