"""The serving pin: the Triton config ``tune-serving`` chose by measurement, as a lock file.

``python -m pipeline tune-serving recipes/<r>.yaml`` (:mod:`pipeline.serve.tune`) measures
candidate configs on a real tritonserver and writes ``recipes/tuned/<r>.serving.json`` beside
the recipe, next to the quantization pin ``<r>.json`` (:mod:`pipeline.quant.pin`, whose style
this file mirrors: a ``match`` that decides whether it applies, what it pins, what it only
records). It holds:

* ``match``: ``hardware`` (the hardware class of the recipe's DECLARED serving target:
  ``gpu:<model>`` from ``triton.serving.gpu``, else ``cpu:<n>`` from ``serve.cpu_cores``; never
  the machine that builds), ``graphs`` (model -> sha256 of the graph file it serves) and
  ``runtimes`` (model -> ``python-onnxruntime`` / ``onnxruntime_onnx`` / ``tensorrt_plan`` /
  ``python``: what the measured server ran);
* ``chosen``: per model the config fields chosen (:data:`COMPUTE_FIELDS`, :data:`GENERATE_FIELDS`);
* ``candidates``: every measured candidate with its numbers; ``summary``: one line;
* ``recorded``: CPU model, Triton version, date, how busy the machine was (recorded only).

Rules (:func:`lookup`): a pin applies only where hardware class and graphs match. Where only the
runtime differs (int8-encoder publishes ``onnxruntime_onnx``; the wheel's tritonserver serves a
``python-onnxruntime`` copy) the published repository keeps the recipe's values and the serve
copy gets the pin (``Lookup.serve_only``). A mismatch is never applied silently: ``Lookup.reason``
names it, and the triton stage prints it. The triton stage's key holds the pin file's digest
(:func:`file_key`), so a new pin republishes; ``config.pbtxt`` never depends on the CPU that
builds (threads are fields, not derived at build time).
"""
from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import RecipeError
from pipeline.quant.pin import json_path

FORMAT = 1
SUFFIX = ".serving.json"
#: resolved target -> the runtime name a pin records (Triton's platform, or the backend)
RUNTIME_NAMES = {"python-onnxruntime": "python-onnxruntime", "onnxruntime": "onnxruntime_onnx",
                 "tensorrt": "tensorrt_plan", "python": "python"}
#: fields a pin may choose for the compute model, and for the generation model
COMPUTE_FIELDS = ("instance_count", "max_batch_size", "dynamic_batching", "intra_op_threads")
GENERATE_FIELDS = ("instance_count", "max_concurrent_generations", "intra_op_threads")


def pin_path(recipe_path: str | Path, name: str) -> Path:
    """``<recipe folder>/tuned/<recipe name>.serving.json``."""
    return Path(recipe_path).parent / "tuned" / f"{name}{SUFFIX}"


def tune_command(recipe_path: str | Path) -> str:
    return f"python -m pipeline tune-serving {recipe_path}"


def hardware_class(recipe) -> str | None:
    """The declared serving target's class: ``gpu:<triton.serving.gpu>``, else
    ``cpu:<serve.cpu_cores>``; None when the recipe declares neither."""
    if recipe.triton.serving is not None:
        return f"gpu:{recipe.triton.serving.gpu}"
    if recipe.serve.cpu_cores is not None:
        return f"cpu:{recipe.serve.cpu_cores}"
    return None


def match_fields(recipe, graphs: dict[str, str], runtimes: dict[str, str]) -> dict:
    """What a pin must match: ``{"hardware", "graphs", "runtimes"}`` (see the module)."""
    return {"hardware": hardware_class(recipe) or "undeclared", "graphs": dict(sorted(graphs.items())),
            "runtimes": dict(sorted(runtimes.items()))}


def _queue(value: dict | None) -> dict | None:
    if value is None:
        return None
    if set(value) - {"max_queue_delay_microseconds", "preferred_batch_size"}:
        raise ValueError("dynamic_batching takes max_queue_delay_microseconds and preferred_batch_size only")
    delay = value.get("max_queue_delay_microseconds", 0)
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
        raise ValueError("max_queue_delay_microseconds must be an integer >= 0")
    pref = value.get("preferred_batch_size")
    if pref is not None and (not isinstance(pref, list) or not all(isinstance(p, int) and p >= 1 for p in pref)):
        raise ValueError("preferred_batch_size must be a list of integers >= 1, or null")
    return value


class Chosen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    role: Literal["compute", "generate"] = Field(description="which model of the recipe")
    instance_count: int | None = Field(None, ge=1)
    max_batch_size: int | None = Field(None, ge=0)
    dynamic_batching: Annotated[dict | None, AfterValidator(_queue)] = None
    max_concurrent_generations: int | None = Field(None, ge=1)
    intra_op_threads: int | None = Field(None, ge=0)


class Match(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    hardware: str = Field(min_length=1)
    graphs: dict[str, Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]]
    runtimes: dict[str, Literal[tuple(RUNTIME_NAMES.values())]]  # type: ignore[valid-type]


class ServingPinFile(BaseModel):
    """The schema of a serving pin (strict: no coercion, no unknown key). :func:`read` applies it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Literal[1]
    match: Match
    chosen: dict[str, Chosen]
    candidates: list[dict[str, Any]] = Field(default_factory=list)
    summary: str = ""
    recorded: dict[str, Any] = Field(default_factory=dict)


def read(path: Path, retune: str = "python -m pipeline tune-serving <recipe>") -> dict:
    """A serving pin's content, validated (:class:`ServingPinFile`).

    Raises:
        RecipeError: (exit 2) not JSON, or not a valid serving pin; names the file and each failing
            key as a JSON path (``chosen["minilm_int8"].instance_count``).
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RecipeError(f"{path}: not a readable serving pin ({e}); re-create it with {retune}") from None
    try:
        ServingPinFile.model_validate(data)
    except ValidationError as e:
        problems = [f"{json_path(tuple(err['loc']))}: {err['msg']}" for err in e.errors()]
        raise RecipeError(f"{path}: not a valid serving pin; re-create it with {retune}:\n  "
                          + "\n  ".join(problems)) from None
    return data


def file_key(recipe_path: str | Path, name: str) -> str:
    """The triton stage key's share: sha256 of the pin file's bytes, or ``none``."""
    path = pin_path(recipe_path, name)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "none"


@dataclass(frozen=True)
class Lookup:
    """Whether the recipe's serving pin applies. ``pinned``: the pin (it exists and is valid);
    ``applies``: hardware, graphs and runtimes match; ``serve_only``: all but the runtimes match
    (the serve copy, run by the measured runtime, gets it); ``reason``: what differs, for people."""

    path: Path
    fields: dict
    pinned: dict | None = None
    applies: bool = False
    serve_only: bool = False
    reason: str = ""
    differences: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.applies:
            return f"serving pin {self.path} applied ({self.pinned.get('summary', '') if self.pinned else ''})"
        return f"serving pin not applied: {self.reason}"


def lookup(recipe, recipe_path: str | Path, graphs: dict[str, str], runtimes: dict[str, str]) -> Lookup:
    """Read the recipe's serving pin and compare its ``match`` with ``graphs`` / ``runtimes`` of
    the repository about to be written (:func:`match_fields`).

    Raises:
        RecipeError: (exit 2) the pin exists but is not valid (:func:`read`).
    """
    path = pin_path(recipe_path, recipe.name)
    fields = match_fields(recipe, graphs, runtimes)
    if not path.is_file():
        return Lookup(path, fields, reason=f"{path} does not exist ({tune_command(recipe_path)} writes it)")
    pin = read(path, tune_command(recipe_path))
    diffs = differences(pin["match"], fields)
    hard = [d for d in diffs if not d.startswith("runtime")]
    if not diffs:
        return Lookup(path, fields, pin, applies=True)
    if not hard:
        return Lookup(path, fields, pin, serve_only=True, differences=diffs,
                      reason=f"{path} was measured on another runtime ({'; '.join(diffs)}): the published "
                             "config keeps the recipe's values; a serve copy run by the measured runtime gets the pin")
    return Lookup(path, fields, pin, differences=diffs,
                  reason=f"{path} does not match ({'; '.join(diffs)}); re-measure with {tune_command(recipe_path)}")


def differences(pinned: dict, fields: dict) -> list[str]:
    """One line per difference between a pin's ``match`` and this repository's."""
    out = []
    if pinned["hardware"] != fields["hardware"]:
        out.append(f"hardware class: pinned {pinned['hardware']!r}, the recipe declares {fields['hardware']!r} "
                   "(triton.serving.gpu / serve.cpu_cores)")
    for model in sorted(set(pinned["graphs"]) | set(fields["graphs"])):
        a, b = pinned["graphs"].get(model), fields["graphs"].get(model)
        if a != b:
            out.append(f"graph of {model}: pinned sha256 {str(a)[:12]}, served {str(b)[:12]}")
    for model in sorted(set(pinned["runtimes"]) | set(fields["runtimes"])):
        a, b = pinned["runtimes"].get(model), fields["runtimes"].get(model)
        if a != b:
            out.append(f"runtime of {model}: measured {a}, this repository {b}")
    return out


def apply(recipe, chosen: dict[str, dict]):
    """``recipe`` with the pin's chosen values in its ``triton`` section (a copy for config
    generation only: the published repository.json keeps the recipe's own hash). The instance kind
    stays the recipe's first group's."""
    from pipeline.recipe.schema import DynamicBatching, InstanceGroup

    t = recipe.triton
    update: dict[str, Any] = {}
    for values in chosen.values():
        v = {k: x for k, x in values.items() if k != "role"}
        if values.get("role") == "compute":
            if v.get("instance_count") is not None:
                update["instance_group"] = [InstanceGroup(count=v["instance_count"], kind=t.instance_group[0].kind)]
            if v.get("max_batch_size") is not None:
                update["max_batch_size"] = v["max_batch_size"]
            if "dynamic_batching" in v:
                db = v["dynamic_batching"]
                update["dynamic_batching"] = None if db is None else DynamicBatching(**db)
            if v.get("intra_op_threads") is not None:
                update["intra_op_threads"] = v["intra_op_threads"]
        elif values.get("role") == "generate":
            if v.get("instance_count") is not None:
                update["generate_instances"] = v["instance_count"]
            if v.get("max_concurrent_generations") is not None:
                update["max_concurrent_generations"] = v["max_concurrent_generations"]
            if v.get("intra_op_threads") is not None:
                update["generate_threads"] = v["intra_op_threads"]
    return recipe.model_copy(update={"triton": t.model_copy(update=update)})


def write(path: Path, fields: dict, chosen: dict[str, dict], candidates: list[dict], summary: str,
          recorded: dict) -> dict:
    """Write the pin (atomically, via a temporary file beside it); returns its content, which
    :func:`read` accepts."""
    data = {"format": FORMAT, "match": fields, "chosen": chosen, "candidates": candidates, "summary": summary,
            "recorded": {**recorded, "date": datetime.date.today().isoformat()}}
    ServingPinFile.model_validate(json.loads(json.dumps(data)))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return data


def served_graphs(recipe, quantized, build, target: str) -> dict[str, str]:
    """model -> sha256 of the graph file the compute model serves: the TensorRT plan for target
    ``tensorrt``, else the quantized ONNX graph (the generation model of python-onnxruntime runs
    that same graph in its own process)."""
    from pipeline.fsutil import sha256_file

    path = build.plan_path if target == "tensorrt" and build.plan_path else quantized.ort_path
    return {recipe.triton.model_name: sha256_file(path)}


def runtimes_of(recipe, target: str, generate_model: str | None) -> dict[str, str]:
    """model -> runtime name (:data:`RUNTIME_NAMES`) of the models a pin may tune."""
    out = {recipe.triton.model_name: RUNTIME_NAMES[target]}
    if generate_model:
        out[generate_model] = "python"
    return out
