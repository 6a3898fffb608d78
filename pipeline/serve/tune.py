"""``tune-serving``: the Triton config chosen by measurement.

A coordinate search (hill climbing one dimension at a time, as Triton Model Analyzer's quick
mode walks its space) over what carries the traffic, on the real tritonserver, each candidate
loaded with ``load_model(name, config=json)`` (explicit model control, no restart) and driven by
bench's closed-loop client (:func:`pipeline.serve.bench.closed_loop`) at one operating point,
``serve.tune.concurrency``:

* the compute model (an encoder's; through BLS an LLM's): ``instance_count``, ``max_batch_size``
  (up to the optimization profiles' max batch: a larger one needs a larger profile, which is
  reported, never rebuilt), ``dynamic_batching`` (off, or its ``max_queue_delay_microseconds``),
  ``preferred_batch_size`` and ONNX Runtime's ``intra_op_threads`` per instance;
* the generation model of python-onnxruntime, which runs the graph in its own process: its
  scheduler limit ``max_concurrent_generations``, ``instance_count`` and ``intra_op_threads``.

Instances x threads never exceed the cores. Along one dimension the search walks away from the
current value in each direction and stops at the first value that does not improve (early
stopping); a pass over every dimension that moves nothing ends the search, and so does
``serve.tune.time_limit_s`` (keeping time for the repeats). Then the best two candidates and
the recipe's default are measured ``serve.tune.repeats`` more times, interleaved (A, B, default,
A, B, default, ...), and decided on the median goodput: a difference within the two candidates'
spread (max - min over their measurements) is a tie, which goes to the one using fewer resources
(:meth:`Candidate.cost`).

Objective: goodput (requests/s meeting ``serve.slo``; DistServe's definition, Zhong et al. 2024)
at the operating point, among feasible candidates: p99 latency <= ``slo.latency_ms`` (encoders),
p99 TTFT <= ``slo.ttft_ms`` and p99 TPOT <= ``slo.tpot_ms`` (generation). A run with any request
error is not a measurement (status ``errors``); a config Triton refuses is named with the
server log's line for it (status ``refused``) and skipped.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.serve.report import save_figure

Log = Callable[[str], None]

#: measurement statuses
OK, REFUSED, ERRORS, INVALID = "ok", "refused", "errors", "invalid"


@dataclass(frozen=True)
class Candidate:
    """One config: role (``compute`` / ``generate``) -> field -> value (:data:`pipeline.triton.pin.COMPUTE_FIELDS`,
    :data:`GENERATE_FIELDS`, plus ``preferred_batch_size``; ``max_queue_delay_microseconds`` None: dynamic
    batching off)."""

    values: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]

    @staticmethod
    def of(values: dict[str, dict[str, Any]]) -> "Candidate":
        return Candidate(tuple(sorted((role, tuple(sorted((k, _frozen(v)) for k, v in fields.items())))
                                      for role, fields in values.items())))

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {role: {k: _thawed(v) for k, v in fields} for role, fields in self.values}

    def get(self, role: str, name: str) -> Any:
        return self.as_dict().get(role, {}).get(name)

    def with_value(self, role: str, name: str, value: Any) -> "Candidate":
        d = self.as_dict()
        d.setdefault(role, {})[name] = value
        return Candidate.of(d)

    def label(self) -> str:
        parts = []
        for role, fields in self.as_dict().items():
            f = dict(fields)
            bits = [f"{f.get('instance_count', 1)} inst"]
            if role == "compute":
                delay = f.get("max_queue_delay_microseconds")
                bits.append("batching off" if delay is None else f"batching {delay} us")
                bits.append(f"mbs {f.get('max_batch_size')}")
                if f.get("preferred_batch_size"):
                    bits.append(f"pref {f['preferred_batch_size']}")
            else:
                bits.append(f"limit {f.get('max_concurrent_generations')}")
            threads = f.get("intra_op_threads") or 0
            bits.append(f"{threads} thr" if threads else "thr auto")
            parts.append(f"{role}: " + ", ".join(bits))
        return "; ".join(parts)

    def cost(self, cores: int) -> tuple:
        """Resources it holds, smaller first: threads in use (0 = derived: all cores), instances,
        then the batch limits and the queue delay."""
        threads = instances = limits = delay = 0
        for _role, f in self.as_dict().items():
            n = int(f.get("instance_count") or 1)
            t = int(f.get("intra_op_threads") or 0)
            threads += n * t if t else cores
            instances += n
            limits += int(f.get("max_batch_size") or 0) + int(f.get("max_concurrent_generations") or 0)
            delay += int(f.get("max_queue_delay_microseconds") or 0)
        return (threads, instances, limits, delay)


def _frozen(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _thawed(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


@dataclass(frozen=True)
class Dimension:
    """One coordinate: ``role``.``name`` takes one of ``values`` (ordered)."""

    role: str
    name: str
    values: tuple


@dataclass
class Measurement:
    """One load run of one candidate. Times in ms, rates per s. ``status``: :data:`OK`, or why it
    is not a measurement (``detail``: the server log's line, the client's error)."""

    status: str
    goodput_rps: float = float("nan")
    throughput_rps: float = float("nan")
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    slo_met: float = float("nan")
    requests: int = 0
    duration_s: float = 0.0
    feasible: bool = False
    detail: str = ""
    over_slo: str = ""  # which p99 missed its bound, for people

    @property
    def ok(self) -> bool:
        """A measurement (status :data:`OK`), not a row saying why there is none."""
        return self.status == OK

    def as_row(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in dataclasses.asdict(self).items()}


@dataclass
class Outcome:
    """What the search found. ``rows``: every measurement in order (candidate label, values,
    phase, measurement); ``chosen`` / ``default``: candidates; ``feasible``: some candidate met the SLO;
    ``decision``: how the best two were decided; ``stopped``: why the search ended; ``cross_check``:
    the AIPerf cross-check on the chosen config (:func:`pipeline.serve.crosscheck.cross_check`), when asked for."""

    default: Candidate
    chosen: Candidate | None = None
    feasible: bool = False
    rows: list[dict] = field(default_factory=list)
    decision: dict = field(default_factory=dict)
    stopped: str = ""
    interrupted: bool = False
    cross_check: dict | None = None

    def samples(self, cand: Candidate) -> list[Measurement]:
        return [r["measurement"] for r in self.rows if r["candidate"] == cand and r["measurement"].status == OK]

    def best_infeasible(self) -> tuple[Candidate, Measurement] | None:
        """The candidate closest to the SLO (lowest p99 over its bound) when none met it."""
        ok = [(r["candidate"], r["measurement"]) for r in self.rows if r["measurement"].status == OK]
        return min(ok, key=lambda cm: (-cm[1].goodput_rps, cm[1].p99_ms), default=None)


def score(m: Measurement) -> tuple:
    """Higher is better: feasible first, then goodput, then the lower p99."""
    if m.status != OK:
        return (False, -math.inf, -math.inf)
    return (m.feasible, m.goodput_rps, -m.p99_ms)


def search(default: Candidate, dimensions: Sequence[Dimension], measure: Callable[[Candidate], Measurement], *,
           time_limit_s: float, repeats: int, cores: int, valid: Callable[[Candidate], str | None] = lambda c: None,
           clock: Callable[[], float] = time.monotonic, log: Log = print, outcome: Outcome | None = None) -> Outcome:
    """The coordinate search, then the interleaved repeats (module docstring).

    Args:
        default: the recipe's config (measured first; the ratio's denominator).
        dimensions: the coordinates, in the order they are walked.
        measure: one load run of a candidate (already loaded by it).
        time_limit_s: the whole search's bound; the search stops when the next measurement and the
            repeats (2 or 3 candidates x ``repeats``, at the mean measurement time) would pass it.
        valid: why a candidate cannot be run (instances x threads over the cores), or None.
        outcome: filled in place, so a Ctrl-C (KeyboardInterrupt, re-raised) leaves the partial table.

    Returns:
        The :class:`Outcome`; ``chosen`` None when nothing was measured; ``feasible`` False when no
        candidate met the SLO.
    """
    out = outcome or Outcome(default)
    start = clock()
    seen: dict[Candidate, Measurement] = {}

    def run(cand: Candidate, phase: str) -> Measurement:
        began = clock()
        m = measure(cand)
        out.rows.append({"candidate": cand, "phase": phase, "measurement": m, "wall_s": clock() - began})
        log(f"  {phase}: {cand.label()}: {_said(m)}")
        return m

    def mean_s() -> float:
        """One candidate's time: its load, warm-up and measurement (the wall time of ``measure``)."""
        ok = [r["wall_s"] for r in out.rows if r["measurement"].status == OK]
        return float(np.mean(ok)) if ok else 0.0

    def time_left(extra: int) -> bool:
        need = mean_s() * (1 + 3 * repeats) if extra else mean_s() * 3 * repeats
        return clock() - start + need <= time_limit_s

    def get(cand: Candidate) -> Measurement | None:
        if cand in seen:
            return seen[cand]
        why = valid(cand)
        if why:
            seen[cand] = Measurement(INVALID, detail=why)
            return seen[cand]
        if not time_left(1):
            return None
        seen[cand] = run(cand, "search")
        return seen[cand]

    seen[default] = run(default, "default")
    current = default
    out.stopped = "a pass over every dimension improved nothing"
    moved = True
    while moved:
        moved = False
        for dim in dimensions:
            if len(dim.values) < 2:
                continue
            here = current.get(dim.role, dim.name)
            values = list(dim.values)
            if here not in values:
                values = sorted(values + [here], key=_order)
            i = values.index(here)
            best, best_m = current, seen[current]
            for step in (1, -1):
                j = i + step
                last = seen[current]
                while 0 <= j < len(values):
                    cand = current.with_value(dim.role, dim.name, values[j])
                    m = get(cand)
                    if m is None:
                        out.stopped = f"the time limit ({time_limit_s:g} s) left room for the repeats only"
                        return _finish(out, default, run, repeats, cores, log)
                    j += step
                    if m.status == INVALID:
                        continue
                    if score(m) <= score(last):
                        break  # early stopping: this direction got no better
                    last = m
                    if score(m) > score(best_m):
                        best, best_m = cand, m
            if best != current:
                current, moved = best, True
    return _finish(out, default, run, repeats, cores, log)


def _order(v: Any) -> tuple:
    """None (batching off) before every number."""
    return (0, 0) if v is None else (1, v if not isinstance(v, tuple) else len(v))


def _finish(out: Outcome, default: Candidate, run, repeats: int, cores: int, log: Log) -> Outcome:
    """Repeat the best two (and the default), interleaved; decide within their spread."""
    best: dict[Candidate, Measurement] = {}
    for r in out.rows:
        m = r["measurement"]
        if m.status == OK and (r["candidate"] not in best or score(m) > score(best[r["candidate"]])):
            best[r["candidate"]] = m
    ranked = sorted(best, key=lambda c: score(best[c]), reverse=True)
    if not ranked:
        return out
    top = ranked[:2]
    group = top + ([default] if default not in top and default in best else [])
    if len(group) > 1 and repeats > 0:
        log(f"repeats: {', '.join(c.label() for c in group)}, {repeats} times, interleaved")
        for _ in range(repeats):
            for c in group:
                run(c, "repeat")
    out.decision = decide(out, top, cores)
    out.chosen = out.decision["chosen"]
    out.feasible = any(m.feasible for m in (_median(out.samples(c)) for c in top) if m is not None)
    return out


def _median(ms: list[Measurement]) -> Measurement | None:
    """The measurement of a candidate's median goodput and median p99s (feasibility recomputed by the caller)."""
    if not ms:
        return None
    m = dataclasses.replace(ms[0])
    m.goodput_rps = float(np.median([x.goodput_rps for x in ms]))
    m.throughput_rps = float(np.median([x.throughput_rps for x in ms]))
    m.p50_ms = float(np.median([x.p50_ms for x in ms]))
    m.p99_ms = float(np.median([x.p99_ms for x in ms]))
    m.feasible = sum(x.feasible for x in ms) * 2 > len(ms)  # most of its runs met the SLO
    return m


def decide(out: Outcome, top: list[Candidate], cores: int) -> dict:
    """Between the best two: median goodput over every measurement of each; a difference within
    the larger of their spreads (max - min) is a tie, won by the smaller :meth:`Candidate.cost`."""
    stats: dict[Candidate, dict[str, Any]] = {}
    for c in top:
        ms = out.samples(c)
        g = [m.goodput_rps for m in ms]
        med = _median(ms)
        stats[c] = {"median": float(np.median(g)), "spread": float(max(g) - min(g)), "runs": len(g),
                    "feasible": bool(med and med.feasible), "p99_ms": med.p99_ms if med else None}
    feasible = [c for c in top if stats[c]["feasible"]] or list(top)
    if len(feasible) == 1:
        only = feasible[0]
        return {"chosen": only, "how": "the only feasible one of the best two" if len(top) > 1 else "the only one",
                "stats": {c.label(): s for c, s in stats.items()}}
    a, b = sorted(feasible, key=lambda c: float(stats[c]["median"]), reverse=True)[:2]
    gap = float(stats[a]["median"]) - float(stats[b]["median"])
    spread = max(float(stats[a]["spread"]), float(stats[b]["spread"]))
    if gap <= spread:
        chosen = min((a, b), key=lambda c: c.cost(cores))
        how = (f"tie: medians {stats[a]['median']:.3g} and {stats[b]['median']:.3g}/s differ by {gap:.3g}, within "
               f"their spread {spread:.3g}; " + ("the one using fewer resources" if a.cost(cores) != b.cost(cores)
                                                 else "equal resources, so the higher median"))
    else:
        chosen = a
        how = f"higher median goodput by {gap:.3g}/s, beyond their spread {spread:.3g}"
    return {"chosen": chosen, "how": how, "stats": {c.label(): s for c, s in stats.items()}}


def _said(m: Measurement) -> str:
    if m.status != OK:
        return f"{m.status}: {m.detail}"
    return (f"goodput {m.goodput_rps:.3g}/s, throughput {m.throughput_rps:.3g}/s, p99 {m.p99_ms:.4g} ms"
            + ("" if m.feasible else f" (misses the SLO: {m.over_slo})"))


def ratio_to_default(out: Outcome) -> dict | None:
    """Chosen over default goodput: the ratio of medians and its spread (min, max of the ratio over
    the interleaved repeat rounds, where both ran in each)."""
    if out.chosen is None:
        return None
    a, d = out.samples(out.chosen), out.samples(out.default)
    if not a or not d:
        return None
    med = float(np.median([m.goodput_rps for m in a])) / max(float(np.median([m.goodput_rps for m in d])), 1e-12)
    pairs = [x.goodput_rps / y.goodput_rps for x, y in zip(a, d) if y.goodput_rps > 0]
    return {"ratio": med, "min": min(pairs) if pairs else None, "max": max(pairs) if pairs else None,
            "runs": min(len(a), len(d))}


def cores_here() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


# ---------------------------------------------------------------- the real server

#: queue delays tried (us); None: dynamic batching off
QUEUE_DELAYS = (None, 0, 100, 1000, 5000)
#: scheduler limits tried for the generation model
SCHEDULER_LIMITS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Space:
    """What is searched for a served recipe: the default, the dimensions, the bounds."""

    default: Candidate
    dimensions: tuple[Dimension, ...]
    cores: int
    profile_max_batch: int | None
    models: dict[str, str]  # role -> Triton model name
    notes: tuple[str, ...] = ()

    def valid(self, cand: Candidate) -> str | None:
        """Why ``cand`` cannot run (instances x threads over the cores, a preferred batch size
        over max_batch_size or without batching, max_batch_size over the profile), or None."""
        for role, f in cand.as_dict().items():
            n, t = int(f.get("instance_count") or 1), int(f.get("intra_op_threads") or 0)
            if t and n * t > self.cores:
                return f"{role}: {n} instances x {t} threads > {self.cores} cores"
            pref, mbs = f.get("preferred_batch_size"), f.get("max_batch_size")
            if pref and (f.get("max_queue_delay_microseconds") is None or mbs is None or pref > mbs):
                return f"{role}: preferred_batch_size {pref} needs dynamic batching and max_batch_size >= it"
            if mbs and self.profile_max_batch and mbs > self.profile_max_batch:
                return (f"{role}: max_batch_size {mbs} > the optimization profile's max batch "
                        f"{self.profile_max_batch} (the profile must grow first)")
        return None


def _config(served, model: str):
    from pipeline.triton.config import parse_config

    return parse_config((served.repository / model / "config.pbtxt").read_text())


def _param(cfg, key: str, default: str = "0") -> str:
    return cfg.parameters[key].string_value if key in cfg.parameters else default


def space(served, *, cores: int, max_instances: int) -> Space:
    """The search space of ``served`` (module docstring), its default read from the served configs."""
    from pipeline.triton.config import THREADS_PARAMETER
    from pipeline.triton.repository import profile_batch

    profile_max = profile_batch(served.artifacts["build"].profiles)[0] if served.artifacts["build"].profiles else None
    instances = tuple(range(1, min(max_instances, cores) + 1))
    threads = tuple(range(0, cores + 1))
    notes = []
    if served.generate_model and served.compute_in_process:
        cfg = _config(served, served.generate_model)
        limit = int(_param(cfg, "max_concurrent_generations", "1"))
        default = Candidate.of({"generate": {
            "instance_count": int(cfg.instance_group[0].count or 1), "max_concurrent_generations": limit,
            "intra_op_threads": int(_param(cfg, "intra_op_threads"))}})
        generate_dims = (Dimension("generate", "max_concurrent_generations",
                                   tuple(sorted(set(SCHEDULER_LIMITS) | {limit}))),
                         Dimension("generate", "instance_count", instances),
                         Dimension("generate", "intra_op_threads", threads))
        notes.append(f"{served.generate_model} runs {served.compute_model}'s graph in its own process, so only its "
                     "own settings shape generation traffic: scheduler limit, instances, threads")
        return Space(default, generate_dims, cores, profile_max, {"generate": served.generate_model}, tuple(notes))
    cfg = _config(served, served.compute_model)
    mbs = int(cfg.max_batch_size)
    db = cfg.dynamic_batching if cfg.HasField("dynamic_batching") else None
    default = Candidate.of({"compute": {
        "instance_count": int(cfg.instance_group[0].count or 1), "max_batch_size": mbs,
        "max_queue_delay_microseconds": int(db.max_queue_delay_microseconds) if db is not None else None,
        "preferred_batch_size": int(db.preferred_batch_size[0]) if db is not None and db.preferred_batch_size else None,
        "intra_op_threads": int(_param(cfg, THREADS_PARAMETER.get(served.target, "intra_op_threads")))}})
    dims = [Dimension("compute", "instance_count", instances)]
    if mbs > 0:
        top = profile_max or mbs
        low = mbs if served.ensemble_model else 1  # an ensemble's max_batch_size is the recipe's: never below it
        sizes = sorted({mbs, top, *(2 ** k for k in range(0, 12) if low <= 2 ** k <= top)})
        dims += [Dimension("compute", "max_queue_delay_microseconds", QUEUE_DELAYS),
                 Dimension("compute", "max_batch_size", tuple(s for s in sizes if s >= low)),
                 Dimension("compute", "preferred_batch_size", (None, *(2 ** k for k in range(1, 12) if 2 ** k <= top)))]
        if profile_max and mbs >= profile_max:
            notes.append(f"max_batch_size is at the optimization profile's max batch {profile_max}: a larger one "
                         "needs a larger profile (build.profiles), which the search does not rebuild")
    if served.target in THREADS_PARAMETER:
        dims.append(Dimension("compute", "intra_op_threads", threads))
    return Space(default, tuple(dims), cores, profile_max, {"compute": served.compute_model}, tuple(notes))


def override(served, role: str, model: str, values: dict) -> str:
    """The served config of ``model`` with a candidate's ``values``, as the JSON Triton's
    ``load_model(name, config=...)`` takes (protobuf JSON, field names as in config.pbtxt)."""
    from google.protobuf import json_format

    from pipeline.triton.config import THREADS_PARAMETER

    cfg = _config(served, model)
    cfg.instance_group[0].count = int(values.get("instance_count") or 1)
    threads = int(values.get("intra_op_threads") or 0)
    key = "intra_op_threads" if role == "generate" else THREADS_PARAMETER.get(served.target)
    if key:
        if threads:
            cfg.parameters[key].string_value = str(threads)
        elif key in cfg.parameters:
            del cfg.parameters[key]
    if role == "generate":
        cfg.parameters["max_concurrent_generations"].string_value = str(values["max_concurrent_generations"])
    else:
        cfg.max_batch_size = int(values["max_batch_size"])
        delay = values.get("max_queue_delay_microseconds")
        if delay is None:
            cfg.ClearField("dynamic_batching")
        else:
            cfg.dynamic_batching.max_queue_delay_microseconds = int(delay)
            del cfg.dynamic_batching.preferred_batch_size[:]
            if values.get("preferred_batch_size"):
                cfg.dynamic_batching.preferred_batch_size.append(int(values["preferred_batch_size"]))
    return json_format.MessageToJson(cfg, preserving_proto_field_name=True)


def chosen_fields(role: str, values: dict) -> dict:
    """A candidate's values as a pin's ``chosen`` entry (:class:`pipeline.triton.pin.Chosen`)."""
    if role == "generate":
        return {"role": role, "instance_count": values["instance_count"],
                "max_concurrent_generations": values["max_concurrent_generations"],
                "intra_op_threads": values.get("intra_op_threads") or 0}
    delay = values.get("max_queue_delay_microseconds")
    pref = values.get("preferred_batch_size")
    return {"role": role, "instance_count": values["instance_count"], "max_batch_size": values["max_batch_size"],
            "dynamic_batching": None if delay is None else {"max_queue_delay_microseconds": delay,
                                                            "preferred_batch_size": [pref] if pref else []},
            "intra_op_threads": values.get("intra_op_threads") or 0}


class ServerDied(Exception):
    """tritonserver exited during the search."""


class Runner:
    """Loads candidates into a running server and measures them (:meth:`measure`)."""

    def __init__(self, served, server, sp: Space, concurrency: "int | Point", log: Log = print):
        point = concurrency if isinstance(concurrency, Point) else Point(concurrency)
        self.served, self.server, self.space, self.point, self.log = served, server, sp, point, log
        cfg = served.recipe.serve
        self.measure_s, self.min_requests = cfg.tune.measure_s, max(cfg.tune.min_requests, point.concurrency or 1)
        self._log_offset = 0
        #: CPU time (s) the last :meth:`drive`'s client threads took (warm-up included; their own
        #: ``time.thread_time``: on the HTTP route all of the client's work; on gRPC not the gRPC
        #: library's own threads).
        self.client_cpu_s = 0.0

    def check_alive(self) -> None:
        from pipeline.triton.server import TritonServerError

        code = self.server.process.poll()
        if code is not None:
            raise TritonServerError(f"tritonserver exited (status {code}) during the search; its log's end:\n"
                                    f"{self.server.logs()[-3000:]}")

    def _refusal(self, model: str, error: Exception) -> str:
        """The server log's line for a load that failed (the RPC says only 'failed to load')."""
        text = self.server.logs()[self._log_offset:]
        lines = [ln for ln in text.splitlines() if model in ln and (ln.startswith("E") or "failed" in ln.lower()
                                                                    or "error" in ln.lower())]
        return (lines[-1].strip() if lines else f"(no server log line; the RPC said: {error})")[:500]

    def load(self, cand: Candidate) -> str | None:
        """Load ``cand``'s config into each model it sets; the refusal's log line, or None."""
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(self.server.grpc_url) as client:
            for role, values in cand.as_dict().items():
                model = self.space.models[role]
                self._log_offset = len(self.server.logs())
                try:
                    client.load_model(model, config=override(self.served, role, model, values))
                except Exception as e:  # InferenceServerException: the reason is in the server log
                    self.check_alive()
                    return self._refusal(model, e)
                self.check_alive()
        return None

    def measure(self, cand: Candidate) -> Measurement:
        """Load ``cand`` (:meth:`load`), then :meth:`drive` it; a refused config is a :data:`REFUSED` row."""
        refused = self.load(cand)
        if refused is not None:
            return Measurement(REFUSED, detail=refused)
        return self.drive()

    def drive(self, http_url: str | None = None, *, nice: int = 0) -> Measurement:
        """One measurement of what is loaded now: warm-up, then the operating point's load. A request
        error makes it an :data:`ERRORS` row, not a measurement.

        Args:
            http_url: None (the search): gRPC straight to Triton. Else the AIPerf cross-check's route,
                AIPerf's own: an encoder's KServe v2 JSON requests to Triton's HTTP address
                (``host:port``; :class:`pipeline.serve.client.KServeHTTP`), or a generation model's
                streamed ``/v1/completions`` through the OpenAI endpoint at this base URL (ending in
                ``/v1``; :class:`pipeline.serve.client.CompletionsHTTP`).
            nice: the load threads lower their CPU priority by this much
                (:func:`pipeline.serve.bench.lower_thread_priority`).

        Raises:
            TritonServerError: (exit 4) the server died (its log's end).
        """
        self.client_cpu_s = 0.0
        try:
            # generation traffic whenever the recipe generates (also when the search tunes the compute model it calls through BLS)
            return (self._measure_llm(http_url, nice) if self.served.generate_model
                    else self._measure_encoder(http_url, nice))
        except KeyboardInterrupt:
            raise
        except Exception as e:  # a request failed: not a measurement
            self.check_alive()
            return Measurement(ERRORS, detail=f"{type(e).__name__}: {str(e)[:300]}")

    def _measure_encoder(self, http_url: str | None = None, nice: int = 0) -> Measurement:
        import tritonclient.grpc as grpcclient

        from pipeline.serve.bench import closed_loop
        from pipeline.serve.client import KServeHTTP, infer_ms
        from pipeline.serve.stats import latency_level

        served, slo = self.served, self.served.recipe.serve.slo
        model = str(served.ensemble_model)
        feeds = served.adapter.bench_workload(served.recipe, served.artifacts["export"].tokenizer_dir).requests
        if http_url is None:
            connect = lambda: grpcclient.InferenceServerClient(self.server.grpc_url)  # noqa: E731
            work = lambda conn, i: infer_ms(conn, model, feeds[i % len(feeds)])  # noqa: E731
        else:
            connect = lambda: KServeHTTP(http_url)  # noqa: E731
            work = lambda conn, i: conn.infer_ms(model, feeds[i % len(feeds)])  # noqa: E731
        warm, cpu = self.point.warm_up, []
        # warm-up: every instance's first calls, not counted
        closed_loop(2 * warm, warm, connect, work, nice=nice, cpu_s=cpu)
        latencies, duration, late = self._load(connect, work, nice=nice, cpu_s=cpu)
        self.client_cpu_s = sum(cpu)
        level = latency_level(latencies, duration, slo.latency_ms)
        p99 = level["latency_ms"]["p99"]
        return Measurement(OK, goodput_rps=level["goodput_rps"], throughput_rps=level["inferences_per_s"],
                           p50_ms=level["latency_ms"]["p50"], p99_ms=p99, slo_met=level["slo_met"],
                           requests=level["requests"], duration_s=duration, feasible=p99 <= slo.latency_ms,
                           over_slo="" if p99 <= slo.latency_ms else f"p99 {p99:.4g} ms > latency_ms {slo.latency_ms:g}",
                           detail=self._late(late))

    def _load(self, connect, work, *, nice: int = 0, cpu_s: list[float] | None = None) -> tuple[list, float, int]:
        """The measurement's load: the closed loop at the concurrency for at least ``measure_s``, or
        the open loop at the rate for ``rate x measure_s`` requests (and ``min_requests``). ``nice``
        and ``cpu_s``: :func:`pipeline.serve.bench.closed_loop`'s (the closed loop only)."""
        from pipeline.serve.bench import closed_loop, open_loop

        if self.point.rate is not None:
            count = max(self.min_requests, math.ceil(self.point.rate * self.measure_s))
            return open_loop(self.point.rate, count, connect, work)
        results, duration = closed_loop(self.min_requests, int(self.point.concurrency or 1), connect, work,
                                        min_duration_s=self.measure_s, nice=nice, cpu_s=cpu_s)
        return results, duration, 0

    @staticmethod
    def _late(late: int) -> str:
        return f"{late} sends started over 10 ms late (the offered rate was not reached)" if late else ""

    def _measure_llm(self, http_url: str | None = None, nice: int = 0) -> Measurement:
        from pipeline.serve.bench import closed_loop, llm_prompt_texts, llm_prompts
        from pipeline.serve.client import CompletionsHTTP, StreamClient
        from pipeline.serve.stats import llm_level

        served, cfg = self.served, self.served.recipe.serve
        model = str(served.generate_model)
        if http_url is None:
            prompts = llm_prompts(served)
            connect = lambda: StreamClient(self.server.grpc_url)  # noqa: E731
            work = lambda client, i: client.generate(model, input_ids=prompts[i % len(prompts)],  # noqa: E731
                                                     max_tokens=cfg.max_tokens, ignore_eos=True)
            warm_up = lambda client, i: client.generate(model, input_ids=prompts[0], max_tokens=2)  # noqa: E731
        else:  # the same prompts as text: the endpoint tokenizes them, as it does AIPerf's
            from tokenizers import Tokenizer

            from pipeline.serve.openai.app import find_model_folder

            texts, _ = llm_prompt_texts(served)
            tok = Tokenizer.from_file(str(find_model_folder(served.repository, model) / "tokenizer.json"))
            count = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
            connect = lambda: CompletionsHTTP(http_url, count)  # noqa: E731
            work = lambda client, i: client.generate(model, texts[i % len(texts)],  # noqa: E731
                                                     max_tokens=cfg.max_tokens, ignore_eos=True)
            warm_up = lambda client, i: client.generate(model, texts[0], max_tokens=2)  # noqa: E731
        warm, cpu = self.point.warm_up, []
        closed_loop(warm, warm, connect, warm_up, nice=nice, cpu_s=cpu)
        gens, duration, late = self._load(connect, work, nice=nice, cpu_s=cpu)
        self.client_cpu_s = sum(cpu)
        level = llm_level(gens, duration, cfg.slo)
        ttft, tpot = level["ttft_ms"]["p99"], level["tpot_ms"]["p99"]
        misses = [f"p99 TTFT {ttft:.4g} ms > ttft_ms {cfg.slo.ttft_ms:g}"] if ttft > cfg.slo.ttft_ms else []
        misses += [f"p99 TPOT {tpot:.4g} ms > tpot_ms {cfg.slo.tpot_ms:g}"] if tpot > cfg.slo.tpot_ms else []
        return Measurement(OK, goodput_rps=level["goodput_rps"], throughput_rps=level["requests_per_s"],
                           p50_ms=level["ttft_ms"]["p50"], p99_ms=ttft, ttft_p99_ms=ttft, tpot_p99_ms=tpot,
                           slo_met=level["slo_met"], requests=level["requests"], duration_s=duration,
                           feasible=not misses, over_slo="; ".join(misses), detail=self._late(late))


@dataclass(frozen=True)
class Point:
    """The operating point: ``concurrency`` (closed loop) or ``rate`` (requests/s, open loop)."""

    concurrency: int | None = None
    rate: float | None = None

    def __str__(self) -> str:
        return f"{self.rate:g} requests/s (open loop)" if self.rate is not None else f"concurrency {self.concurrency}"

    @property
    def warm_up(self) -> int:
        """Concurrent warm-up requests: the concurrency, or the rate's requests in one second (2 to 16)."""
        return int(self.concurrency) if self.concurrency else max(2, min(16, math.ceil(self.rate or 2)))


def operating_point(recipe) -> Point:
    """``serve.tune.rate`` (open loop), else ``serve.tune.concurrency``, else the largest of ``serve.concurrency``."""
    t = recipe.serve.tune
    return Point(rate=t.rate) if t.rate is not None else Point(t.concurrency or max(recipe.serve.concurrency))


def run(served, *, log: Log = print, outcome: Outcome | None = None, cores: int | None = None,
        cross_check_rounds: int | None = None) -> tuple[Outcome, Space, dict]:
    """Start tritonserver on ``served`` (the recipe's own values), search, stop it. With
    ``cross_check_rounds``, before it stops, the chosen config is loaded again and our client and
    AIPerf alternate on it (:func:`pipeline.serve.crosscheck.cross_check`, ``outcome.cross_check``;
    its files in ``<run dir>/tune_serving/cross_check/``).

    Returns the outcome, the space and the environment (Triton version, CPU, load average before
    and after). A Ctrl-C leaves the partial table in ``outcome`` (pass one in) and re-raises.

    Raises:
        TritonServerError: (exit 4) the server did not start, or died during the search (its log's end).
        KeyboardInterrupt: Ctrl-C / SIGTERM.
    """
    from pipeline.serve.bench import environment
    from pipeline.serve.run import launch

    cfg = served.recipe.serve
    sp = space(served, cores=cores or cores_here(), max_instances=cfg.tune.max_instances)
    c = operating_point(served.recipe)
    for note in sp.notes:
        log(f"note: {note}")
    log(f"search: {len(sp.dimensions)} dimensions ({', '.join(f'{d.role}.{d.name}' for d in sp.dimensions)}), "
        f"{c}, >= {cfg.tune.measure_s:g} s per measurement, time limit {cfg.tune.time_limit_s:g} s")
    out = outcome or Outcome(sp.default)
    with launch(served) as server:
        env = {**environment(server), "cpu_model": cpu_model(), "cores_used": sp.cores}
        runner = Runner(served, server, sp, c, log)
        search(sp.default, sp.dimensions, runner.measure, time_limit_s=cfg.tune.time_limit_s,
               repeats=cfg.tune.repeats, cores=sp.cores, valid=sp.valid, log=log, outcome=out)
        env["loadavg_1m_end"] = os.getloadavg()[0]
        if cross_check_rounds and out.chosen is not None:
            out.cross_check = cross_check_chosen(served, server, runner, out.chosen, cross_check_rounds, log)
    return out, sp, env


def cross_check_chosen(served, server, runner: "Runner", chosen: Candidate, rounds: int, log: Log = print) -> dict:
    """Load ``chosen`` and run :func:`pipeline.serve.crosscheck.cross_check` on it."""
    from pipeline.serve.crosscheck import cross_check

    refused = runner.load(chosen)
    if refused is not None:
        return {"failed": f"the chosen config did not load again: {refused}"}
    return cross_check(served, server, runner, rounds=rounds, folder=served.run_dir / "tune_serving" / "cross_check",
                       log=log)




def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


# ---------------------------------------------------------------- report and pin

PLOT_FILE = "throughput_p99.png"


def summary_line(out: Outcome, c: "Point | int") -> str:
    """One line: what changed and what it bought (the chosen over the default, ratio and spread)."""
    if out.chosen is None:
        return "nothing was measured"
    r = ratio_to_default(out)
    bought = (f"goodput x{r['ratio']:.2f} of the default's (ratio of medians; per-pair ratios {r['min']:.2f}-"
              f"{r['max']:.2f} over {r['runs']} runs of each, the search's and the interleaved repeats)"
              if r and r["min"] is not None else "no repeated comparison with the default")
    if out.chosen == out.default:
        return f"the recipe's config stays ({out.default.label()}) at {c}: {bought}"
    changed = [f"{role}.{k} {out.default.get(role, k)} -> {v}" for role, f in out.chosen.as_dict().items()
               for k, v in f.items() if out.default.get(role, k) != v]
    return f"{', '.join(changed)} at {c}: {bought}"


def table(out: Outcome, llm: bool) -> list[str]:
    p = "TTFT " if llm else ""
    head = (f"| # | phase | candidate | status | goodput/s | throughput/s | {p}p50 ms | {p}p99 ms |"
            + (" TPOT p99 ms |" if llm else "") + " SLO |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(out.rows, 1):
        m, cand = r["measurement"], r["candidate"]
        mark = " (default)" if cand == out.default else ""
        mark += " **(chosen)**" if cand == out.chosen else ""
        if m.status != OK:
            lines.append(f"| {i} | {r['phase']} | {cand.label()}{mark} | {m.status}: {m.detail} |" + " |" * (
                5 + llm) + "")
            continue
        lines.append(f"| {i} | {r['phase']} | {cand.label()}{mark} | ok | {m.goodput_rps:.3g} | {m.throughput_rps:.3g} | "
                     f"{m.p50_ms:.4g} | {m.p99_ms:.4g} |" + (f" {m.tpot_p99_ms:.4g} |" if llm else "")
                     + (" met |" if m.feasible else f" missed: {m.over_slo} |"))
    return lines


def write_plot(out: Outcome, slo_ms: float, path, llm: bool) -> str:
    """Throughput against p99 latency (p99 TTFT for generation), one point per measurement, with
    the SLO line, the default and the chosen config marked. PNG (matplotlib). Returns the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [r for r in out.rows if r["measurement"].status == OK]
    ax.scatter([r["measurement"].throughput_rps for r in ok], [r["measurement"].p99_ms for r in ok], s=18,
               color="0.6", label="candidates")
    for cand, style, label in ((out.default, "s", "recipe's default"), (out.chosen, "*", "chosen")):
        pts = [r["measurement"] for r in ok if r["candidate"] == cand]
        if pts:
            ax.scatter([m.throughput_rps for m in pts], [m.p99_ms for m in pts], marker=style, s=120, label=label,
                       edgecolors="black", zorder=3)
    ax.axhline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel("requests/s")
    ax.set_ylabel("p99 TTFT (ms)" if llm else "p99 latency (ms)")
    ax.set_title("tune-serving: throughput vs p99")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def report(out: Outcome, sp: Space, env: dict, served, folder, *, pinned_to=None, note: str = "") -> dict:
    """Write ``tune.json``, ``tune.md`` and the plot into ``folder``; returns the JSON's content
    (``markdown``: the text)."""
    from pipeline.fsutil import write_json_atomic

    llm = bool(getattr(served, "generate_model", None))
    slo = served.recipe.serve.slo
    c = operating_point(served.recipe)
    folder.mkdir(parents=True, exist_ok=True)
    plot = write_plot(out, slo.ttft_ms if llm else slo.latency_ms, folder / PLOT_FILE, llm) if out.rows else None
    line = summary_line(out, c)
    bounds = (f"p99 TTFT <= {slo.ttft_ms:g} ms and p99 TPOT <= {slo.tpot_ms:g} ms" if llm
              else f"p99 latency <= {slo.latency_ms:g} ms")
    md = [f"## tune-serving {served.recipe.name}: tritonserver {env.get('tritonserver', '?')}, target {served.target}",
          "", f"{env.get('cpu_model', '?')}, {env.get('cpus', '?')} CPUs ({sp.cores} searched over), 1-min load "
          f"average {env.get('loadavg_1m', float('nan')):.2f} at start, {env.get('loadavg_1m_end', float('nan')):.2f} "
          "at end (shared CPU: numbers move with other load).", "",
          f"Objective: goodput (requests/s meeting serve.slo) at {c}; feasible: {bounds}. "
          f"Models searched: {', '.join(sp.models.values())}.", ""]
    md += [f"- {n}" for n in sp.notes] + ([""] if sp.notes else [])
    if note:
        md += [note, ""]
    md += table(out, llm) + [""]
    if out.decision:
        md.append(f"Decision between the best two: {out.decision['how']}.")
    md.append(f"Search ended: {out.stopped or ('interrupted' if out.interrupted else '?')}.")
    if out.interrupted:
        md.append("Interrupted (Ctrl-C): this is the partial table; nothing was pinned.")
    elif out.chosen is not None and not out.feasible:
        best = out.best_infeasible()
        md.append(f"No candidate met the SLO; the best, {best[0].label()}, had p99 {best[1].p99_ms:.4g} ms. "
                  "Nothing was pinned." if best else "No candidate was measured; nothing was pinned.")
    if pinned_to:
        md.append(f"Pinned: {pinned_to}.")
    md += ["", f"**{line}**", ""] + ([f"![throughput vs p99]({plot})", ""] if plot else [])
    if out.cross_check is not None:
        from pipeline.serve.crosscheck import render

        md += render(out.cross_check) + [""]
    result = {"recipe": served.recipe.name, "concurrency": c.concurrency, "rate": c.rate, "slo": slo.model_dump(mode="json"),
              "environment": env, "notes": list(sp.notes), "summary": line, "interrupted": out.interrupted,
              "feasible": out.feasible, "stopped": out.stopped,
              "default": out.default.as_dict(), "chosen": out.chosen.as_dict() if out.chosen else None,
              "decision": {k: v for k, v in out.decision.items() if k != "chosen"},
              "ratio_to_default": ratio_to_default(out), "candidates": candidate_rows(out), "plot": plot,
              "cross_check": out.cross_check,
              "markdown": "\n".join(md)}
    write_json_atomic(folder / "tune.json", {k: v for k, v in result.items() if k != "markdown"}, strict=True)
    (folder / "tune.md").write_text(result["markdown"])
    return result


def candidate_rows(out: Outcome) -> list[dict]:
    """Every measurement: the candidate's values and label, the phase, the numbers."""
    return [{"label": r["candidate"].label(), "values": r["candidate"].as_dict(), "phase": r["phase"],
             "default": r["candidate"] == out.default, **r["measurement"].as_row()} for r in out.rows]


def pin_chosen(out: Outcome, sp: Space) -> dict[str, dict]:
    """The pin's ``chosen``: per Triton model name, :func:`chosen_fields` of the chosen candidate."""
    assert out.chosen is not None
    return {sp.models[role]: chosen_fields(role, values) for role, values in out.chosen.as_dict().items()}


# ---------------------------------------------------------------- the command

def add_tune_serving_arguments(parser) -> None:
    """``tune-serving``'s arguments: the recipe ones, and ``--note`` (recorded in the pin)."""
    parser.add_argument("recipe", help="path to a recipe YAML, e.g. recipes/int8-encoder.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe field for this run (serve.* only changes no pin match)")
    parser.add_argument("--quiet", action="store_true", help="no build progress output")
    parser.add_argument("--note", default="", help="recorded in the pin's `recorded.note` (e.g. the machine was shared)")
    parser.add_argument("--cross-check", choices=["aiperf"], default=None,
                        help="after the search, alternate our client and AIPerf on the chosen config at the operating "
                             "point and report AIPerf/ours throughput (off by default: each AIPerf run adds about a "
                             "minute of its own start-up on 2 cores)")
    parser.add_argument("--cross-check-rounds", type=int, default=3, metavar="N",
                        help="AIPerf runs in the cross-check, each between two of ours (default 3)")


def cmd_tune_serving(args) -> int:
    """Build (cached), start the server on the recipe's own config, search, stop; pin the choice in
    ``recipes/tuned/<r>.serving.json``. Exit 1 when no candidate meets ``serve.slo`` (nothing
    pinned); 130 on Ctrl-C (the partial table is written, nothing pinned).

    With ``--cross-check aiperf`` the chosen config is then driven by our client and AIPerf in turn
    (:mod:`pipeline.serve.crosscheck`); the pin does not depend on it, but a cross-check whose runs had
    request errors (or whose AIPerf failed) exits 4 after pinning, as ``bench`` does for AIPerf.

    Raises:
        RecipeError: (exit 2, before any work) the recipe declares no hardware class
            (``triton.serving.gpu`` or ``serve.cpu_cores``); the pin folder cannot be written;
            ``--cross-check-rounds`` below 1.
        TritonServerError: (exit 4) the server did not start or died mid-search (log tail).
    """
    from pathlib import Path

    from pipeline.errors import RecipeError
    from pipeline.run.preflight import check_pin_folder, preflight
    from pipeline.serve.prepare import built_artifacts
    from pipeline.serve.run import prepare_for_server
    from pipeline.triton import pin
    from pipeline.triton.repository import repository_runtime

    rounds = getattr(args, "cross_check_rounds", 3)
    if getattr(args, "cross_check", None) and rounds < 1:
        raise RecipeError(f"--cross-check-rounds {rounds}: the cross-check needs at least 1 AIPerf run")
    recipe, _ = preflight(args)
    if pin.hardware_class(recipe) is None:
        raise RecipeError(f"{args.recipe}: a serving pin matches the DECLARED serving hardware, and this recipe "
                          "declares none: set serve.cpu_cores (the serving host's CPU cores) or triton.serving "
                          "(its GPU); the build machine's is never taken")
    dest = pin.pin_path(args.recipe, recipe.name)
    check_pin_folder(dest)
    served = prepare_for_server(recipe, built_artifacts(recipe, Path(args.recipe), quiet=args.quiet),
                                Path(args.recipe), use_pin=False)
    print(served.note)
    folder = served.run_dir / "tune_serving"
    sp = space(served, cores=cores_here(), max_instances=recipe.serve.tune.max_instances)
    out = Outcome(sp.default)
    env: dict = {}
    try:
        out, sp, env = run(served, outcome=out, cross_check_rounds=rounds if getattr(args, "cross_check", None) else None)
    except KeyboardInterrupt:
        out.interrupted = True
        report(out, sp, env, served, folder)
        print(f"interrupted: the partial table is in {folder / 'tune.md'}; nothing pinned", file=sys.stderr)
        raise
    published = repository_runtime(recipe.triton.target, served.artifacts["build"])
    code = finish(out, sp, env, served, Path(args.recipe), note=args.note, published_target=published)
    return cross_check_exit(out.cross_check, code)


def cross_check_exit(result: dict | None, code: int) -> int:
    """The exit code after a cross-check: ``code`` (the search's), else 4 (EXIT_ENVIRONMENT) when the
    cross-check failed (request errors or AIPerf failing: not a measurement), said on stderr."""
    from pipeline.errors import EXIT_ENVIRONMENT

    if result is None:
        return code
    if "failed" in result:
        print(f"tune-serving: the AIPerf cross-check failed: {result['failed']}", file=sys.stderr)
        return code or EXIT_ENVIRONMENT
    if "skipped" in result:
        print(f"tune-serving: the AIPerf cross-check was not run: {result['skipped']}", file=sys.stderr)
    return code


def finish(out: Outcome, sp: Space, env: dict, served, recipe_path, *, note: str = "",
           published_target: str | None = None) -> int:
    """After the search: the report, and the pin when a candidate met the SLO. Returns the exit
    code: 0 pinned; 1 no candidate met ``serve.slo`` (the best one and its p99 named, nothing pinned).
    ``published_target``: the runtime ``make build`` publishes; where it is not the measured one,
    the report and the console say that the published config keeps the recipe's values."""
    from pipeline.stages.triton import serving_pin
    from pipeline.triton import pin

    recipe, folder = served.recipe, served.run_dir / "tune_serving"
    dest = pin.pin_path(recipe_path, recipe.name)
    if out.chosen is None or not out.feasible:
        result = report(out, sp, env, served, folder)
        print(result["markdown"])
        best = out.best_infeasible()
        said = (f"the best candidate, {best[0].label()}, had p99 {best[1].p99_ms:.4g} ms" if best
                else "no candidate could be measured")
        print(f"tune-serving: no candidate met serve.slo at {operating_point(recipe)}: {said}; "
              f"nothing pinned ({folder / 'tune.md'})", file=sys.stderr)
        return 1
    q, b = served.artifacts["quantize"], served.artifacts["build"]
    fields = pin.match_fields(recipe, pin.served_graphs(recipe, q, b, served.target),
                              pin.runtimes_of(recipe, served.target, served.generate_model))
    line = summary_line(out, operating_point(recipe))
    recorded = {"cpu_model": env.get("cpu_model"), "cpus": env.get("cpus"), "cores_searched": sp.cores,
                "tritonserver": env.get("tritonserver"), "loadavg_1m_start": env.get("loadavg_1m"),
                "loadavg_1m_end": env.get("loadavg_1m_end"), "concurrency": operating_point(recipe).concurrency,
                "rate": operating_point(recipe).rate,
                "slo": recipe.serve.slo.model_dump(mode="json"), "note": note,
                "ratio_to_default": ratio_to_default(out), "decision": out.decision.get("how", "")}
    pin.write(dest, fields, pin_chosen(out, sp), candidate_rows(out), line, recorded)
    where = ""
    if published_target is not None and published_target != served.target:
        published = serving_pin(recipe, recipe_path, q, b, published_target)
        where = published.reason if published.serve_only else ""
    result = report(out, sp, env, served, folder, pinned_to=str(dest), note="\n\n".join(x for x in (note, where) if x))
    print(result["markdown"])
    print(f"pinned: {dest}\nreport: {folder / 'tune.md'}")
    return 0
