"""manifest.json, report.md and junit.xml: what ran, with what, and the verdict."""
from __future__ import annotations

import functools
import hashlib
import sys
import json
import math
import os
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape, quoteattr

import numpy as np

from pipeline.fsutil import file_sha256, write_text_atomic  # noqa: F401  (write_text_atomic: re-exported)

if TYPE_CHECKING:  # type only: pipeline.datasets imports this module, and the recipe will import datasets
    from pipeline.recipe import Recipe

_TOOLS = {"torch": "torch", "onnx": "onnx", "onnxruntime": "onnxruntime-gpu", "transformers": "transformers",
          "numpy": "numpy", "ml_dtypes": "ml_dtypes"}
#: CPU features that change ONNX Runtime's kernels (INT8 GEMMs: VNNI; FP32: AVX-512), hence the numbers.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def _cpuinfo(field: str) -> str | None:
    """The value of the first ``field`` line of Linux ``/proc/cpuinfo``; None where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((l.split(":", 1)[1].strip() for l in lines if l.split(":", 1)[0].strip() == field), None)


def cpu_description() -> str:
    """``"<machine> <flag>..."``: the architecture and which of :data:`_CPU_FLAGS` the CPU
    has (Linux ``/proc/cpuinfo``; the architecture alone elsewhere). FP8 perplexity moves
    ~0.4 % when activation scales move by one float32 ulp, so kernels matter."""
    import platform

    flags = set((_cpuinfo("flags") or "").split())
    return " ".join([platform.machine(), *(f for f in _CPU_FLAGS if f in flags)])


def cpu_model() -> str:
    """The CPU's model name, e.g. ``"AMD EPYC 9654 96-Core Processor"``: ``/proc/cpuinfo``
    ``model name`` (x86), else :func:`platform.processor`, else ``"unknown"``. Recorded in
    the manifest (``cpu_model``) so two runners' numbers can be told apart; it is not part
    of :func:`tool_versions`, hence of no stage key (the flags, which pick the kernels, are)."""
    import platform

    return _cpuinfo("model name") or platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def tool_versions() -> dict[str, str]:
    """Versions of the tools that shape the artifacts; TensorRT or "absent"."""
    out = {k: _version(d) for k, d in _TOOLS.items()}
    if out["onnxruntime"] == "absent":
        out["onnxruntime"] = _version("onnxruntime")
    try:
        import tensorrt  # type: ignore[import-not-found]

        out["tensorrt"] = tensorrt.__version__
    except Exception:
        out["tensorrt"] = "absent"
    out["trt-pipeline"] = f"{_version('trt-pipeline')}+src.{code_hash()[:12]}"
    out["python"] = sys.version.split()[0]
    out["cpu"] = cpu_description()
    return out


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """sha256 of this package's Python sources and templates: a code change invalidates the stage cache."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f"{f.relative_to(root)}\0".encode() + f.read_bytes())
    return h.hexdigest()


def sha256_file(path: str | Path, _cache: dict = {}) -> str:
    """sha256 hex digest of a file (:func:`pipeline.fsutil.file_sha256`), memoised on
    (path, size, mtime): for stage keys, which hash the same large files many times.
    Verification of published files uses the unmemoised one."""
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _cache:
        _cache[key] = file_sha256(Path(path))
    return _cache[key]


def new_manifest(recipe: Recipe, recipe_path: Path, versions: dict) -> dict:
    """The manifest's skeleton: the recipe, its hash and ``inputs.{name}: {path, sha256}``
    for the model file and each data use (each source hashes its own files).

    Raises:
        DataError: a data file is missing.
    """
    from pipeline.models.sources import manifest_input

    return {
        "recipe_path": str(recipe_path),
        "recipe_hash": recipe.digest,
        "recipe": recipe.model_dump(mode="json", by_alias=True),
        "inputs": {
            "model_file": manifest_input(recipe.model),
            **data_inputs(recipe, Path(recipe_path).parent),
        },
        "versions": versions,
        "cpu_model": cpu_model(),
        "stages": {},
    }


def data_uses(recipe: Recipe, base_dir: Path) -> dict:
    """Recipe key -> bound data source of each data use (calibration, tuning, validate)."""
    from pipeline import datasets

    uses = {}
    sections = (("quantize.calibration", recipe.quantize.calibration), ("quantize.tuning", recipe.quantize.tuning),
                ("validate", recipe.validate_))
    for key, section in sections:
        if section is None:  # no calibration at fp16/fp32; no tuning without an accuracy budget
            continue
        uses[f"{key}.data"] = datasets.load(section.data, base_dir, where=f"{key}.data")
    return uses


def data_inputs(recipe: Recipe, base_dir: Path) -> dict[str, dict[str, str]]:
    """``{use: {path, sha256}}`` of the recipe's data uses (see :func:`data_uses`)."""
    from pipeline import datasets

    return datasets.manifest_inputs(data_uses(recipe, base_dir))


def stage_record(status: str, reason: str = "", wall_s: float = 0.0, peak_rss_mib: float | None = None) -> dict:
    return {"status": status, "reason": reason, "wall_s": round(wall_s, 2), "peak_rss_mib": peak_rss_mib}


REASON_SUFFIX = "_reason"


def _nonfinite_reason(value: float) -> str:
    return f"not a finite number ({value!r})"


def _clean(value):
    """``value`` with numpy scalars made Python ones and non-finite floats made None."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return strict_jsonable(value) if isinstance(value, (dict, list, tuple)) else value


def strict_jsonable(data):
    """A copy of ``data`` (dicts, lists, tuples, scalars) that strict JSON can hold:
    every NaN/inf float (numpy scalars included) becomes ``None``. In a dict, a
    key ``k`` that lost its value gets ``k + "_reason"`` unless the producer
    already set one (e.g. "the naive_ort model gave 384 non-finite embeddings");
    a list that lost an element gets the reason under its own key.

    Returns the new object; the input is not changed.
    """
    if isinstance(data, dict):
        out: dict = {}
        for k, v in data.items():
            out[k] = _clean(v)
            reason_key = f"{k}{REASON_SUFFIX}"
            if reason_key in data or not isinstance(k, str):
                continue
            if out[k] is None and v is not None:
                out[reason_key] = _nonfinite_reason(float(v))
            elif isinstance(v, (list, tuple)) and _lost(v, out[k]):
                out[reason_key] = f"elements {_lost(v, out[k])} were not finite numbers (written as null)"
        return out
    if isinstance(data, (list, tuple)):
        return [_clean(v) for v in data]
    return _clean(data)


def _lost(before, after) -> list[int]:
    """Indices where a list element was a value and became None."""
    return [i for i, (a, b) in enumerate(zip(before, after)) if a is not None and b is None]


def write_json_atomic(path: Path, data: dict, *, strict: bool = True) -> None:
    """Write ``data`` as indented JSON via a temp file and rename.

    ``strict=True`` (metrics.json, manifest.json, bench.json): sanitised with
    :func:`strict_jsonable` first, then dumped with ``allow_nan=False``, so the
    file is strict JSON (RFC 8259) that any parser reads; the default, also for
    the stage cache (``GateResult.value`` reads ``null`` back as NaN).
    ``strict=False`` keeps Python's NaN/Infinity tokens.
    Objects JSON does not know are written as ``str(obj)``.

    Raises:
        ValueError: a non-finite float the sanitiser cannot reach (a NaN dict
            key); nothing is written.
    """
    if strict:
        text = json.dumps(strict_jsonable(data), indent=2, default=str, allow_nan=False)
    else:
        text = json.dumps(data, indent=2, default=str)
    write_text_atomic(path, text)


def write_outputs(man: dict, run_dir: Path) -> Path:
    """Write manifest.json (strict JSON), report.md and junit.xml into ``run_dir``;
    all three from the same sanitised copy, so a value written as null shows as
    ``n/a (reason)`` in the report."""
    clean = strict_jsonable(man)
    write_json_atomic(run_dir / "manifest.json", clean, strict=True)
    write_text_atomic(run_dir / "report.md", report_markdown(clean))
    write_text_atomic(run_dir / "junit.xml", junit_xml(clean))
    return run_dir / "manifest.json"


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
        cache = "hit" if r.get("cache_hit") else "miss"
        lines.append(f"| {st} | {r['status']} | {cache} | {r['wall_s']} | {r.get('peak_rss_mib')} | {r['reason']} |")
    if man.get("metrics"):
        lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
        lines += _metric_rows(man["metrics"])
    for title, section in man.get("sections", {}).items():  # added after the build, e.g. by `pipeline plan`
        lines += ["", f"## {title}", "", capped_section(section["markdown"], section.get("file"))]
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
        bound = f"{g['op']} {_fmt(g['bound'])}" if g.get("bound") is not None else "-"
        rows.append(f"| {g['name']} | {g.get('metric', '-')} | {value} | {bound} | {margin} | {verdict} |")
        if g.get("stderr_method"):
            notes.append(f"standard error of {g['metric']}: {g['stderr_method']}, over {g.get('n')} "
                         f"eval {g.get('n_unit')}")
        if g.get("statistic", "point") != "point":
            notes.append(f"{g['name']}: {g['statistic']} at confidence {g.get('confidence')}: compared with "
                         f"threshold {_fmt(g.get('threshold'))} (bound ± z·se; pipeline/gates.py)")
    return rows + ([""] + [f"- {n}" for n in dict.fromkeys(notes)] if notes else [])


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


def add_report_section(run_dir: Path, title: str, markdown: str) -> None:
    """Add (or replace) a titled section of the last run's report.md and manifest.json
    (no-op when the recipe has no manifest yet)."""
    path = run_dir / "manifest.json"
    if not path.is_file():
        return
    man = json.loads(path.read_text())
    man.setdefault("sections", {})[title] = {"markdown": markdown}
    write_outputs(man, run_dir)


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
        why = reason or (_nonfinite_reason(v) if isinstance(v, float) else "no value")
        return f"n/a ({why})"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def junit_xml(man: dict) -> str:
    """One <testcase> per accuracy gate, plus one per failed stage. A gate's case holds
    ``<properties>`` (value, stderr, bound, margin_se, within_noise, n, statistic,
    threshold: the fields it has) and its message as ``<system-out>``; a failed gate's
    message is also the ``<failure>`` message."""
    gates = man.get("gates", [])
    failed_stages = {k: v for k, v in man["stages"].items() if v["status"] == "failed"}
    cases = []
    for g in gates:
        body = "" if g["passed"] else f"<failure message={quoteattr(g['message'])}/>"
        props = "".join(f"<property name={quoteattr(k)} value={quoteattr(str(g[k]))}/>" for k in _JUNIT_PROPERTIES
                        if g.get(k) is not None)
        out = f"<properties>{props}</properties>{body}<system-out>{escape(g['message'])}</system-out>"
        cases.append(f'  <testcase classname="gates" name={quoteattr(g["name"])}>{out}</testcase>')
    for st, r in failed_stages.items():
        cases.append(f'  <testcase classname="stages" name={quoteattr(st)}><error message={quoteattr(r["reason"])}/></testcase>')
    failures = sum(not g["passed"] for g in gates)
    name = escape(man["recipe"]["name"])
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="{name}" tests="{len(cases)}" '
            f'failures="{failures}" errors="{len(failed_stages)}">\n' + "\n".join(cases) + "\n</testsuite>\n")


#: GateResult fields written as junit ``<property>`` of a gate's test case
_JUNIT_PROPERTIES = ("metric", "value", "stderr", "op", "bound", "margin_se", "within_noise", "n", "n_unit",
                     "n_needed", "statistic", "threshold")
