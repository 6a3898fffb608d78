"""Data sources: one union for calibration, validation and the bench.

* :data:`DataSource`: the recipe type (``pipeline/sources/data/schema.py``), a
  union discriminated on ``type``: ``corpus``, ``text``, ``jsonl``, ``pairs``,
  ``images``, ``npz`` (one reader module each).
* :func:`load`: a mapping or model -> a source bound to the recipe folder.
* :func:`check_disjoint`: calibration, tuning and eval data must not overlap.

A run hashes each source once (:func:`pipeline.provenance.inputs`).
"""
from __future__ import annotations

from collections.abc import Mapping
from itertools import combinations
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from pipeline.sources.data.base import Claim, DataError, Labeled, Pair, sha256_file
from pipeline.sources.data.schema import (CorpusSource, DataSource, ImagesSource, JsonlSource, NpzSource, PairsSource,
                                      Range, TextSource)

__all__ = ["DataSource", "CorpusSource", "TextSource", "JsonlSource", "PairsSource", "ImagesSource", "NpzSource",
           "Range", "DataError", "Labeled", "Pair", "load", "check_disjoint"]

_ADAPTER: TypeAdapter = TypeAdapter(DataSource)


def load(spec: Mapping | DataSource, base_dir: str | Path | None, where: str = "data") -> DataSource:
    """A data source bound to the recipe folder ``base_dir``.

    Args:
        spec: the recipe mapping (``{type: text, path: ...}``) or a validated source.
        base_dir: folder that relative paths are read from (the recipe file's folder).
        where: the recipe key of this use (``validate.data``), named by every error.

    Raises:
        DataError: the mapping breaks the schema; names ``where``, the key and what is valid.
    """
    if not isinstance(spec, Mapping):
        return spec.bind(base_dir, where)
    try:
        source = _ADAPTER.validate_python(dict(spec))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join([where, *map(str, err['loc'])])}: {err['msg']}" for err in e.errors())
        raise DataError(problems) from None
    return source.bind(base_dir, where)


def check_disjoint(uses: dict[str, DataSource]) -> None:
    """Refuse data shared between uses (calibration, tuning, eval...), for every source type.

    Two uses reading the same file (or built-in corpus) with overlapping ranges
    overlap; so do two different files with the same content hash (a copy
    cannot be proved disjoint). The same file read as two different record
    units (``text`` and ``jsonl``) cannot be compared and is refused too.
    Then the records themselves: two uses whose texts (documents, a JSONL
    field, sentence pairs) share a record after :func:`normalized` (NFKC,
    case-folded, whitespace collapsed) overlap, whatever files and source types
    they come through (a text file and a JSONL file of the same documents, a
    lower-cased copy, one document in two ranges of a corpus). Images and npz
    feeds are compared by their files' bytes (above).

    Args:
        uses: recipe key of each use (``quantize.calibration.data``) -> its source.

    Raises:
        DataError: (exit 2) naming both uses, the file and both ranges; or both uses,
            both sources and how many records they share, with the first one.
    """
    claims = {name: src.claims() for name, src in uses.items()}
    for (a, ca), (b, cb) in combinations(claims.items(), 2):
        _same_files(a, ca, b, cb)
        _same_content(a, uses[a], ca, b, uses[b], cb)
    records = {name: found for name, src in uses.items() if (found := _record_hashes(src)) is not None}
    for (a, (fa, ra)), (b, (fb, rb)) in combinations(records.items(), 2):
        if fa != fb:
            continue
        shared = ra.keys() & rb.keys()
        if shared:
            first = min(shared, key=lambda h: ra[h][0])
            (i, text), (j, _) = ra[first], rb[first]
            shown = text if len(text) <= 60 else text[:57] + "..."
            raise DataError(
                f"{a} and {b} share {len(shared)} record{'s' if len(shared) > 1 else ''}: {uses[a].describe()} and "
                f"{uses[b].describe()} hold the same {fb} (compared case-folded, whitespace collapsed), e.g. record "
                f"{i} of {a} and record {j} of {b}: {shown!r}; valid: data with no record in common (validate must "
                "measure on records that calibration and tuning never saw)")


def normalized(text: str) -> str:
    """``text`` as records are compared: NFKC, case-folded, runs of whitespace as one space, stripped."""
    import unicodedata

    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def _record_hashes(src: DataSource) -> tuple[str, dict[str, tuple[int, str]]] | None:
    """(record family, normalized-record sha256 -> (first index in the split, the record as text))
    of a text source; None for images and npz feeds (their files are compared by content). A JSONL
    field that holds JSON other than a string (a generic model's feeds) is its canonical JSON.

    Raises:
        DataError: the source's records cannot be read (as :meth:`items`).
    """
    import hashlib
    import json

    kind = src.record_kind
    if kind not in ("documents", "labeled_documents", "pairs"):
        return None
    records = src._reader().values(src) if isinstance(src, JsonlSource) else src.items()
    out: dict[str, tuple[int, str]] = {}
    for i, rec in enumerate(records):
        if kind == "pairs":
            text = "\t".join(sorted((normalized(rec.text_a), normalized(rec.text_b))))
        elif isinstance(rec, str):
            text = normalized(rec)
        else:
            text = json.dumps(rec, sort_keys=True, separators=(",", ":"))
        if not text:  # an empty JSONL field holds no data to share
            continue
        out.setdefault(hashlib.sha256(text.encode()).hexdigest(), (src.split.start + i, text))
    return ("sentence pairs" if kind == "pairs" else "texts"), out


def _same_files(a: str, ca: list[Claim], b: str, cb: list[Claim]) -> None:
    by_path = {c.path: c for c in cb}
    for x in ca:
        y = by_path.get(x.path)
        if y is None:
            continue
        if x.unit != y.unit:
            raise DataError(f"{a} and {b} both read {x.path}, as {x.unit}s and as {y.unit}s; their ranges cannot "
                            f"be compared: read it with one source type in both")
        if x.range is None or y.range is None or x.range.overlaps(y.range):
            raise DataError(f"{a} and {b} overlap: both read {x.path}, {_span(x)} and {_span(y)}; "
                            f"valid: disjoint {x.unit} ranges")


def _span(c: Claim) -> str:
    return "all of it" if c.range is None else f"{c.unit}s {c.range}"


def _same_content(a: str, sa, ca: list[Claim], b: str, sb, cb: list[Claim]) -> None:
    hashes = {sha256_file(c.path): c.path for c in ca}
    for c in cb:
        twin = hashes.get(sha256_file(c.path))
        if twin is not None and twin != c.path:
            raise DataError(f"{a} and {b} overlap: {twin} ({sa.describe()}) and {c.path} ({sb.describe()}) are "
                            f"different files with identical content; valid: data that is not a copy")

