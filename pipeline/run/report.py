"""manifest.json, report.md and junit.xml: what ran, with what, and the verdict."""
from __future__ import annotations

import json
import re
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from xml.sax.saxutils import escape, quoteattr

from pipeline.fsutil import REASON_SUFFIX, nonfinite_reason, strict_jsonable, write_json_atomic, write_text_atomic
from pipeline.provenance import cpu_model
from pipeline.recipe.checks import GENERATION_METRICS
from pipeline.recipe.precisions import PRECISIONS

if TYPE_CHECKING:
    from pipeline.recipe.schema import Recipe


def new_manifest(recipe: Recipe, recipe_path: Path, versions: dict, inputs: dict[str, dict[str, str]]) -> dict:
    """The manifest's skeleton: the recipe, its hash and ``inputs`` (``{name: {path, sha256}}``,
    :func:`pipeline.provenance.inputs` of :func:`input_sources`, hashed once by the runner)."""
    return {
        "recipe_path": str(recipe_path),
        "recipe_hash": recipe.digest,
        "recipe": recipe.model_dump(mode="json", by_alias=True),
        "inputs": inputs,
        "versions": versions,
        "cpu_model": cpu_model(),
        "stages": {},
    }


def data_uses(recipe: Recipe, base_dir: Path) -> dict:
    """Recipe key -> bound data source of each data use (calibration, tuning, validate)."""
    from pipeline.sources import data as datasets

    uses = {}
    sections = (("quantize.calibration", recipe.quantize.calibration), ("quantize.tuning", recipe.quantize.tuning),
                ("validate", recipe.validate_))
    for key, section in sections:
        if section is None:  # no calibration at fp16/fp32; no tuning without an accuracy budget
            continue
        uses[f"{key}.data"] = datasets.load(section.data, base_dir, where=f"{key}.data")
    return uses


def input_sources(recipe: Recipe, base_dir: Path) -> Iterator[tuple[str, Any]]:
    """``(manifest input name, source)`` of each file a run reads, for :func:`pipeline.provenance.inputs`:
    ``model_file`` (the recipe's model source), then each data use (:func:`data_uses`, bound once the
    model file is hashed).

    Raises:
        DataError: a data section does not bind (:func:`data_uses`).
    """
    yield "model_file", recipe.model.source
    yield from data_uses(recipe, base_dir).items()


def stage_record(status: str, reason: str = "", wall_s: float = 0.0, peak_rss_mib: float | None = None) -> dict:
    return {"status": status, "reason": reason, "wall_s": round(wall_s, 2), "peak_rss_mib": peak_rss_mib}


def write_outputs(man: dict, run_dir: Path) -> Path:
    """Write manifest.json (strict JSON), report.md and junit.xml into ``run_dir``;
    all three from the same sanitised copy, so a value written as null shows as
    ``n/a (reason)`` in the report."""
    clean = strict_jsonable(man)
    write_json_atomic(run_dir / "manifest.json", clean, strict=True)
    write_text_atomic(run_dir / "report.md", report_markdown(clean))
    write_text_atomic(run_dir / "junit.xml", junit_xml(clean))
    return run_dir / "manifest.json"


#: Folder (in the run dir) of the last run that did not pass, where the run dir keeps a passing run's outputs.
FAILED_DIR = "failed"


def last_manifest(run_dir: Path) -> dict:
    """``run_dir/manifest.json`` as the last run wrote it; ``{}`` when there is none or it is not
    a JSON object (never raises: callers read one field of it)."""
    try:
        man = json.loads((Path(run_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return man if isinstance(man, dict) else {}


def write_run_outputs(man: dict, run_dir: Path) -> Path:
    """:func:`write_outputs` for a run, into the folder that keeps the published run's record: a
    passing run writes into ``run_dir`` (and removes ``run_dir/failed/``, now stale); a run that did
    not pass (a failed gate, a failed or interrupted stage) writes into ``run_dir/failed/`` when
    ``run_dir/manifest.json`` records a passing run, so the manifest and report of the run whose
    models ``output_dir`` still holds are never rewritten; else into ``run_dir``. Returns the
    manifest's path."""
    import shutil

    if man.get("verdict") == "pass":
        shutil.rmtree(run_dir / FAILED_DIR, ignore_errors=True)
        return write_outputs(man, run_dir)
    kept = last_manifest(run_dir).get("verdict") == "pass"
    out = run_dir / FAILED_DIR if kept else run_dir
    out.mkdir(parents=True, exist_ok=True)
    return write_outputs(man, out)


#: console and report line of a build whose recipe has no gates.
NO_GATES = "no gates: validate.gates is empty, so nothing was enforced"


#: a report section longer than this many lines or bytes is cut there, with a pointer to its file
SECTION_MAX_LINES = 60
SECTION_MAX_BYTES = 6000


def report_markdown(man: dict) -> str:
    """report.md: first screen the verdict, the gate table (value ± standard error, bound,
    margin in standard errors, verdict / within noise) and the stage table; then the
    metrics, the stages' sections (each cut at :data:`SECTION_MAX_LINES` lines /
    :data:`SECTION_MAX_BYTES` bytes with a pointer to its full file), versions last."""
    name = man["recipe"]["name"]
    lines = [f"# {name}: {man.get('verdict', 'incomplete').upper()}"]
    if "gates" in man:
        lines += ["", "## Gates", ""] + (gate_table(man["gates"]) if man["gates"] else [f"- {NO_GATES}"])
    lines += ["", "## Stages", "",
              "| stage | status | cache | wall (s) | peak RSS (MiB) | notes |", "|---|---|---|---|---|---|"]
    for st, r in man["stages"].items():
        cache = ("hit (remote)" if r.get("cache_source") == "remote" else "hit") if r.get("cache_hit") else "miss"
        lines.append(f"| {st} | {r['status']} | {cache} | {r['wall_s']} | {r.get('peak_rss_mib')} | {r['reason']} |")
    if man.get("remote_cache"):
        rc = man["remote_cache"]
        lines += ["", f"Remote stage cache {rc['url']}: pulled {', '.join(rc['pulled']) or 'none'}; pushed "
                      f"{', '.join(rc['pushed']) or 'none'}; already there {', '.join(rc['present']) or 'none'}."]
        lines += [f"- warning: {w}" for w in rc["warnings"]]
    lines += tuning_lines(man.get("tuning"), man["recipe"].get("quantize", {}))
    lines += speed_lines(man.get("metrics") or {}, (man.get("artifacts") or {}).get("quantize") or {})
    if man.get("metrics"):
        lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
        lines += _metric_rows(man["metrics"])
        lines += generation_note(man["metrics"], man.get("gates") or [])
    for title, section in man.get("sections", {}).items():  # added after the build, e.g. by `pipeline plan`
        lines += ["", f"## {title}", "", capped_section(nested_headings(section["markdown"]), section.get("file"))]
    lines += ["", "## Versions", ""] + [f"- {k}: {v}" for k, v in man["versions"].items()]
    if man.get("cpu_model"):
        lines.append(f"- cpu model: {man['cpu_model']}")
    return "\n".join(lines) + "\n"


def gate_table(gates: list[dict]) -> list[str]:
    """Markdown rows of the manifest's ``gates`` (:class:`pipeline.artifacts.GateResult`
    as dicts): gate | metric | value ± se | bound | margin (SE) | verdict; then one line
    per standard-error method and per statistical test. Fields an older manifest lacks show "-"."""
    rows = ["| gate | metric | value ± se | bound | margin (SE) | verdict |", "|---|---|---|---|---|---|"]
    notes: list[str] = []
    for g in gates:
        value = _fmt(g.get("value"), g.get("value_reason")) + (f" ± {g['stderr']:.2g}" if g.get("stderr") is not None
                                                               else "")
        margin = f"{g['margin_se']:+.2f}" if isinstance(g.get("margin_se"), (int, float)) else "-"
        verdict = "pass" if g["passed"] else "**FAIL**"
        if g.get("within_noise"):
            verdict += ", within noise" + (f": ~{g['n_needed']:,} eval {g.get('n_unit') or 'units'} would resolve it"
                                           if g.get("n_needed") else " (on the bound)")
        elif g.get("within_noise") is False and margin != "-":
            verdict += ", clear of noise"  # |margin| >= gates.NOISE_SE standard errors
        bound = f"{g['op']} {_fmt(g['bound'])}" if g.get("bound") is not None else "-"
        rows.append(f"| {g['name']} | {g.get('metric', '-')} | {value} | {bound} | {margin} | {verdict} |")
        if g.get("stderr_method"):
            notes.append(f"standard error of {g['metric']}: {g['stderr_method']}, over {g.get('n')} "
                         f"eval {g.get('n_unit')}")
        if g.get("statistic", "point") != "point":
            notes.append(f"{g['name']}: {g['statistic']} at confidence {g.get('confidence')}: compared with "
                         f"threshold {_fmt(g.get('threshold'))} (bound ± z·se; pipeline/recipe/gates.py)")
    return rows + ([""] + [f"- {n}" for n in dict.fromkeys(notes)] if notes else [])


def nested_headings(markdown: str, levels: int = 2) -> str:
    """``markdown`` with each ATX heading ``levels`` deeper (at most ``######``), outside code
    fences: a section file's own ``# Title`` sits under the report's ``## Section``."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            hashes = len(line) - len(line.lstrip("#"))
            if line[hashes:hashes + 1] in (" ", ""):
                line = "#" * min(6, hashes + levels) + line[hashes:]
        out.append(line)
    return "\n".join(out)


def capped_section(markdown: str, file: str | None = None, max_lines: int = SECTION_MAX_LINES,
                   max_bytes: int = SECTION_MAX_BYTES) -> str:
    """``markdown`` stripped, cut after ``max_lines`` lines or before ``max_bytes`` UTF-8
    bytes (whole lines), whichever comes first, ending with a line naming how much was
    left out and where the full text is (``file``, relative to the run folder; else
    manifest.json's ``sections``)."""
    text = markdown.strip()
    lines = text.splitlines()
    kept, size = [], 0
    for line in lines[:max_lines]:
        size += len(line.encode()) + 1
        if size > max_bytes:
            break
        kept.append(line)
    if len(kept) == len(lines):
        return text
    where = f"`{file}`" if file else "manifest.json (`sections`)"
    return "\n".join(kept) + f"\n\n... {len(lines) - len(kept)} more lines: the full section is in {where}"


def tuning_lines(tuning: dict | None, quantize: dict) -> list[str]:
    """The report's line on where the quantize stage's calibration and exclusions came from:
    a pinned tuning result (:mod:`pipeline.quant.pin`), or a search/calibration run here and why."""
    if not tuning or quantize.get("calibration") is None:
        return []
    if tuning["source"] == "pinned":
        return ["", f"Tuning: **pinned** result `{tuning['pin']}` (calibration amax and exclusions; "
                    "no calibration or search ran)."]
    what = "calibration and the accuracy-budget search" if quantize.get("accuracy_budget") else "calibration"
    return ["", f"Tuning: {what} ran on this machine ({tuning['reason']}); CPU kernels can move its result "
                "in the last bits: `python -m pipeline tune <recipe>` pins it."]


def speed_lines(metrics: dict, quantize: dict) -> list[str]:
    """The report's line on ``speedup_vs_fp32``: the timed shape, and how many GEMMs carry the
    quantized precision. INT8 at level 'all' runs integer GEMMs, so the ones kept in high precision
    run at FP32 speed and bound the whole graph's speedup (Amdahl's law); FP8, and INT8 below 'all',
    are simulated on a CPU (quantize, dequantize, FP32 GEMM), so there the quantized GEMMs are the
    slower ones (``metrics.speed.speed_note``)."""
    speedup = metrics.get("speedup_vs_fp32")
    if not isinstance(speedup, (int, float)) or not quantize.get("quantized_nodes"):
        return []
    done, kept = len(quantize["quantized_nodes"]), len(quantize.get("excluded_nodes") or [])
    precision, level = quantize.get("precision"), metrics.get("speed_level")
    how = [str(metrics["speed_shape"])] if metrics.get("speed_shape") else []
    how += [f"median of {metrics['speed_runs']} interleaved runs"] if metrics.get("speed_runs") else []
    how += [f"ONNX Runtime level '{level}'"] if level else []
    line = f"Speed: {speedup:.2f}x FP32" + (f" ({', '.join(how)})" if how else "")
    line += f"; {done} of {done + kept} GEMMs run in {precision}"
    if precision not in PRECISIONS or not PRECISIONS[precision].integer or level != "all":
        line += " Q/DQ, simulated on this CPU (quantize, dequantize, FP32 GEMM), so they are the slower ones"
    elif kept:
        line += f"; the other {kept}, kept in high precision for accuracy, run at FP32 speed and bound the speedup"
    return ["", line + "."]


def add_report_section(run_dir: Path, title: str, markdown: str) -> None:
    """Add (or replace) a titled section of the last run's report.md and manifest.json
    (no-op when the recipe has no manifest yet)."""
    path = run_dir / "manifest.json"
    if not path.is_file():
        return
    man = json.loads(path.read_text())
    man.setdefault("sections", {})[title] = {"markdown": markdown}
    write_outputs(man, run_dir)


def generation_note(metrics: dict, gates: list[dict]) -> list[str]:
    """Why ungated greedy-generation metrics may look low: after the first token that differs from
    FP32's, a greedy continuation differs at every later position."""
    shown = sorted(GENERATION_METRICS & set(metrics))
    if not shown or any(g.get("metric") in GENERATION_METRICS for g in gates):
        return []
    return ["", f"{', '.join(shown)}: greedy generation compared with FP32's, not gated here. One token that "
                "differs changes every token after it, so these fall fast under any quantization; the per-token "
                "gates above (KL divergence, perplexity) measure the distributions themselves."]


def _metric_rows(metrics: dict) -> list[str]:
    """Table rows; a value written as null shows ``n/a (<its reason>)`` and its
    reason gets no row of its own."""
    rows = []
    for k, v in metrics.items():
        if isinstance(v, (dict, list)):
            continue
        if k.endswith(REASON_SUFFIX) and k[: -len(REASON_SUFFIX)] in metrics:
            continue
        rows.append(f"| {k} | {_fmt(v, metrics.get(f'{k}{REASON_SUFFIX}'))} |")
    return rows


def _fmt(v, reason: str | None = None) -> str:
    """A metric value for report.md; a missing or non-finite one is ``n/a (reason)``."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        why = reason or (nonfinite_reason(v) if isinstance(v, float) else "no value")
        return f"n/a ({why})"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


#: what XML 1.0 cannot hold (control characters but tab, LF, CR) and ANSI colour codes
_NOT_XML = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _attr(text: object) -> str:
    return quoteattr(_NOT_XML.sub("", str(text)))


def _text(text: object) -> str:
    return escape(_NOT_XML.sub("", str(text)))


def junit_xml(man: dict) -> str:
    """One <testcase> per accuracy gate, plus one per failed stage. A gate's case holds
    ``<properties>`` (value, stderr, bound, margin_se, within_noise, n, statistic,
    threshold: the fields it has) and its message as ``<system-out>``; a failed gate's
    message is also the ``<failure>`` message. Characters XML 1.0 cannot hold (a control
    character, an ANSI colour code in an error message) are left out, so the file parses."""
    gates = man.get("gates", [])
    failed_stages = {k: v for k, v in man["stages"].items() if v["status"] == "failed"}
    cases = []
    for g in gates:
        body = "" if g["passed"] else f"<failure message={_attr(g['message'])}/>"
        props = "".join(f"<property name={_attr(k)} value={_attr(g[k])}/>" for k in _JUNIT_PROPERTIES
                        if g.get(k) is not None)
        out = f"<properties>{props}</properties>{body}<system-out>{_text(g['message'])}</system-out>"
        cases.append(f'  <testcase classname="gates" name={_attr(g["name"])}>{out}</testcase>')
    for st, r in failed_stages.items():
        cases.append(f'  <testcase classname="stages" name={_attr(st)}><error message={_attr(r["reason"])}/></testcase>')
    failures = sum(not g["passed"] for g in gates)
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name={_attr(man["recipe"]["name"])} tests="{len(cases)}" '
            f'failures="{failures}" errors="{len(failed_stages)}">\n' + "\n".join(cases) + "\n</testsuite>\n")


#: GateResult fields written as junit ``<property>`` of a gate's test case
_JUNIT_PROPERTIES = ("metric", "value", "stderr", "op", "bound", "margin_se", "within_noise", "n", "n_unit",
                     "n_needed", "statistic", "threshold")
