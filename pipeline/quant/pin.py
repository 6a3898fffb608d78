"""Pinned tuning results: the calibration and accuracy-budget outcome as a lock file (issue 18 §1).

``python -m pipeline tune recipes/<r>.yaml`` (``make tune RECIPE=<r>`` for this checkout's recipes) calibrates, runs the
sensitivity pass and the budget search, and writes ``recipes/tuned/<r>.json`` beside the recipe
(outside the ``recipes/*.yaml`` glob). ``build`` then uses that file when it matches, and runs
neither calibration nor the search: the graph it quantizes is the same on every runner, whatever
its CPU kernels (one float32 ulp in an FP8 scale moves perplexity measurably).

A pin holds:

* ``excluded``: module scopes (or node names) left in high precision, besides ``quantize.exclude``;
* ``amax``: per-tensor activation amax of every quantized GEMM input (the calibration result);
* ``channel_amax``: SmoothQuant's per-channel input amax (float32, little endian, base64), if used;
* ``metrics``: what the search reached on the tuning split;
* ``match``: what it must match (:func:`match_fields`), and ``recorded``: what it only records
  (tool versions, CPU, date). It never matches on the package's source hash, so a refactor keeps
  every pin; :data:`SEARCH_VERSION` is bumped by hand when the search or calibration changes meaning.
"""
from __future__ import annotations

import base64
import datetime
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.errors import RecipeError

#: bump when pipeline/quant/budget.py, sensitivity.py or calibrate.py change what a search or a
#: calibration produces for the same inputs (every pin is then stale and says so). 3: the FP32
#: reference session runs without weight prepacking (its GEMMs differ in the last bits)
SEARCH_VERSION = 3
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


#: quantize fields added after pins were written -> their default (left out of the digest at it)
_ADDED_FIELDS = {"reduce_range": False}


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
        return PinLookup(path, fields, reason=f"{path} is stale: {', '.join(_what(k) for k in changed)} changed "
                                              f"since it was tuned ({tune_command(recipe_path)} re-tunes)")
    return PinLookup(path, fields, pinned=pin)


_WHAT = {"search_version": "the search/calibration code (SEARCH_VERSION)", "model": "the model file",
         "quantize": "the quantize section"}


def _what(key: str) -> str:
    return _WHAT.get(key, key)


def read(path: Path, retune: str = "python -m pipeline tune <recipe>") -> dict:
    """A pin file's content; ``retune``: the command the errors give (:func:`tune_command`).

    Raises:
        RecipeError: not JSON, or a key is missing (names the file and the key).
    """
    try:
        pin = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RecipeError(f"{path}: not a readable pinned tuning result ({e}); re-create it with {retune}") from None
    for k in ("format", "match", "excluded", "amax"):
        if not isinstance(pin, dict) or k not in pin:
            raise RecipeError(f"{path}: pinned tuning result has no {k!r}; re-create it with {retune}")
    return pin


def candidate(fields: dict, *, excluded: list[str], amax: dict[str, float], channel_amax: dict[str, np.ndarray],
              metrics: dict, search: dict, recorded: dict) -> dict:
    """The pin's content (the quantize stage writes it as ``quantize/tuned.json``).

    ``amax`` values are kept exactly (JSON floats round-trip float64); ``channel_amax`` as
    float32 bytes, base64."""
    return {"format": FORMAT, "match": fields, "excluded": list(excluded),
            "amax": {k: float(v) for k, v in sorted(amax.items())},
            "channel_amax": {k: base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
                             for k, v in sorted(channel_amax.items())},
            "metrics": metrics, "search": search,
            "recorded": {**recorded, "date": datetime.date.today().isoformat()}}


def channel_amax(pin: dict) -> dict[str, np.ndarray]:
    """SmoothQuant's pinned per-channel amax, float32 ``[channels]`` per activation."""
    return {k: np.frombuffer(base64.b64decode(v), "<f4").copy() for k, v in pin.get("channel_amax", {}).items()}


def check_locked(recipe, found: PinLookup) -> None:
    """``build --locked``: a recipe whose quantize stage would search needs a matching pin.

    Raises:
        RecipeError: (exit 2) no pin, or a stale one, saying which input changed.
    """
    if recipe.quantize.accuracy_budget is not None and found.pinned is None:
        raise RecipeError(f"--locked: quantize.accuracy_budget would run a search, and {found.reason}")
