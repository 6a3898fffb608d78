"""A JSONL file: one JSON object per line, the text in ``field`` and an
optional label in ``label_field``. Blank lines are skipped; the range counts
records (non-blank lines)."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.sources.data.base import Claim, DataError, Labeled, read_text, resolve, select

UNIT = "record"


def files(src) -> list[Path]:
    return [resolve(src, src.path, "path")]


def _value(src, path: Path, lineno: int, obj: dict, key: str, field: str, text: bool):
    if key not in obj:
        raise DataError(f"{src._where}.{field}: {path} line {lineno}: the record has no field {key!r} "
                        f"(its fields: {sorted(obj)})")
    value = obj[key]
    if text and not isinstance(value, str):
        raise DataError(f"{src._where}.{field}: {path} line {lineno}: field {key!r} is "
                        f"{type(value).__name__}, not a string")
    if not text and not isinstance(value, (str, int, float, bool)):
        raise DataError(f"{src._where}.{field}: {path} line {lineno}: label {key!r} is "
                        f"{type(value).__name__}; valid: a string, number or boolean")
    return value


def items(src) -> list:
    """The texts (``list[str]``), or ``list[Labeled(text, label)]`` when
    ``label_field`` is set, of records ``src.split``. Only records in the range
    are parsed.

    Raises:
        DataError: the file is missing or not UTF-8; a record in range is not a
            JSON object or lacks a field (names the line number); the split is
            empty or reaches past the file.
    """
    path = files(src)[0]
    out = []
    for lineno, obj in _objects(src, path):
        text = _value(src, path, lineno, obj, src.field, "field", text=True)
        if src.label_field is None:
            out.append(text)
        else:
            out.append(Labeled(text, _value(src, path, lineno, obj, src.label_field, "label_field", text=False)))
    return out


def _objects(src, path: Path) -> list[tuple[int, dict]]:
    """(line number, JSON object) of the records ``src.split``."""
    lines = [(n, line) for n, line in enumerate(read_text(src, path).split("\n"), 1) if line.strip()]
    start, stop = select(src, len(lines), UNIT, str(path))
    out = []
    for lineno, line in lines[start:stop]:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{src._where}.path: {path} line {lineno}: not JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{src._where}.path: {path} line {lineno}: a JSON {type(obj).__name__}; "
                            f"valid: one JSON object per line")
        out.append((lineno, obj))
    return out


def values(src) -> list:
    """The ``field`` value of each record ``src.split``, of any JSON type (a generic model's
    records hold objects of numeric rows there), for the shared-record check.

    Raises:
        DataError: as :func:`items`, but for a value that is not a string.
    """
    path = files(src)[0]
    out = []
    for lineno, obj in _objects(src, path):
        if src.field not in obj:
            _value(src, path, lineno, obj, src.field, "field", text=False)  # raises, naming the line
        out.append(obj[src.field])
    return out


def claims(src) -> list[Claim]:
    return [Claim(files(src)[0].resolve(), UNIT, src.split)]


def describe(src) -> str:
    label = f", label {src.label_field!r}" if src.label_field else ""
    return f"JSONL {src.path}, field {src.field!r}{label}, records {src.split}"
