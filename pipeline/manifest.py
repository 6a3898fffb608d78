"""manifest.json, report.md and junit.xml: what ran, with what, and the verdict."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from pipeline.recipe import Recipe

_TOOLS = {"torch": "torch", "onnx": "onnx", "onnxruntime": "onnxruntime-gpu", "transformers": "transformers"}


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
    """sha256 hex digest of a file, memoised on (path, size, mtime)."""
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _cache:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        _cache[key] = h.hexdigest()
    return _cache[key]


def new_manifest(recipe: Recipe, recipe_path: Path, versions: dict) -> dict:
    from pipeline.data import CORPORA, test_data_dir
    from pipeline.models.llm import package_file

    corpus = test_data_dir() / CORPORA[recipe.validate_.dataset]
    return {
        "recipe_path": str(recipe_path),
        "recipe_hash": recipe.digest,
        "recipe": recipe.model_dump(mode="json", by_alias=True),
        "inputs": {
            "model_file": {"path": str(package_file(recipe.model)), "sha256": _tree_hash(package_file(recipe.model))},
            "corpus": {"path": str(corpus), "sha256": sha256_file(corpus)},
        },
        "versions": versions,
        "stages": {},
    }


def _tree_hash(path: Path) -> str:
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}:{sha256_file(f)}".encode())
    return h.hexdigest()


def stage_record(status: str, reason: str = "", wall_s: float = 0.0, peak_rss_mib: float | None = None) -> dict:
    return {"status": status, "reason": reason, "wall_s": round(wall_s, 2), "peak_rss_mib": peak_rss_mib}


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, default=str))


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def write_outputs(man: dict, run_dir: Path) -> Path:
    """Write manifest.json, report.md and junit.xml into ``run_dir``."""
    write_json_atomic(run_dir / "manifest.json", man)
    write_text_atomic(run_dir / "report.md", report_markdown(man))
    write_text_atomic(run_dir / "junit.xml", junit_xml(man))
    return run_dir / "manifest.json"


def report_markdown(man: dict) -> str:
    name = man["recipe"]["name"]
    lines = [f"# {name}: {man.get('verdict', 'incomplete').upper()}", "", "## Stages", "",
             "| stage | status | cache | wall (s) | peak RSS (MiB) | notes |", "|---|---|---|---|---|---|"]
    for st, r in man["stages"].items():
        cache = "hit" if r.get("cache_hit") else "miss"
        lines.append(f"| {st} | {r['status']} | {cache} | {r['wall_s']} | {r.get('peak_rss_mib')} | {r['reason']} |")
    if man.get("gates"):
        lines += ["", "## Gates", ""] + [f"- {g['message']}" for g in man["gates"]]
    if man.get("metrics"):
        lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in man["metrics"].items() if not isinstance(v, (dict, list))]
    lines += ["", "## Versions", ""] + [f"- {k}: {v}" for k, v in man["versions"].items()]
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def junit_xml(man: dict) -> str:
    """One <testcase> per accuracy gate, plus one per failed stage."""
    gates = man.get("gates", [])
    failed_stages = {k: v for k, v in man["stages"].items() if v["status"] == "failed"}
    cases = []
    for g in gates:
        body = "" if g["passed"] else f"<failure message={quoteattr(g['message'])}/>"
        cases.append(f'  <testcase classname="gates" name={quoteattr(g["name"])}>{body}</testcase>')
    for st, r in failed_stages.items():
        cases.append(f'  <testcase classname="stages" name={quoteattr(st)}><error message={quoteattr(r["reason"])}/></testcase>')
    failures = sum(not g["passed"] for g in gates)
    name = escape(man["recipe"]["name"])
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="{name}" tests="{len(cases)}" '
            f'failures="{failures}" errors="{len(failed_stages)}">\n' + "\n".join(cases) + "\n</testsuite>\n")
