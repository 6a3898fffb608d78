"""Sentence pairs with a gold score in a CSV or TSV file: a user's own STS set.

Columns are given by header name or 0-based index; the delimiter comes from the
extension (``.csv`` comma, ``.tsv``/``.tab`` tab) unless ``delimiter`` is set.
TSV is read without quote handling (STS files hold bare quotes). The range
counts data rows (header and blank rows excluded).
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from pipeline.sources.data.base import Claim, DataError, Pair, read_text, resolve, select

UNIT = "row"
DELIMITERS = {".csv": ",", ".tsv": "\t", ".tab": "\t"}
COLUMNS = ("text_a", "text_b", "score")


def files(src) -> list[Path]:
    return [resolve(src, src.path, "path")]


def _delimiter(src, path: Path) -> str:
    if src.delimiter is not None:
        return src.delimiter
    if path.suffix.lower() not in DELIMITERS:
        raise DataError(f"{src._where}.delimiter: cannot tell the delimiter of {path} from its extension; "
                        f"valid: a {', '.join(DELIMITERS)} file, or set delimiter")
    return DELIMITERS[path.suffix.lower()]


def _rows(src, path: Path) -> tuple[list[str] | None, list[tuple[int, list[str]]]]:
    """``(header or None, [(line number, cells)])`` of the non-blank rows."""
    delim = _delimiter(src, path)
    stream = io.StringIO(read_text(src, path), newline="")
    if delim == "\t":
        reader = csv.reader(stream, delimiter=delim, quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(stream, delimiter=delim)
    try:
        rows = [(reader.line_num, row) for row in reader if any(c.strip() for c in row)]
    except csv.Error as e:
        raise DataError(f"{src._where}.path: {path} line {reader.line_num}: not {delim!r}-delimited text ({e})") from None
    if not src.header:
        return None, rows
    if not rows:
        raise DataError(f"{src._where}.path: {path} is empty; valid: a header row, then one pair per row")
    return [c.strip() for c in rows[0][1]], rows[1:]


def _index(src, path: Path, header: list[str] | None, field: str) -> int:
    col = getattr(src, field)
    if isinstance(col, int):
        return col
    if header is None or col not in header:
        raise DataError(f"{src._where}.{field}: column {col!r} is not in the header of {path}; valid: one of "
                        f"{header} or a 0-based column index")
    return header.index(col)


def items(src) -> list[Pair]:
    """``Pair(text_a, text_b, score)`` for the rows ``src.split``.

    Raises:
        DataError: the file is missing or unreadable; a named column is not in
            the header; a row in range lacks a column or its score is not a
            finite number (names the line); the split is empty or reaches past
            the file.
    """
    path = files(src)[0]
    header, rows = _rows(src, path)
    cols = [_index(src, path, header, f) for f in COLUMNS]
    start, stop = select(src, len(rows), UNIT, str(path))
    out = []
    for lineno, row in rows[start:stop]:
        for field, c in zip(COLUMNS, cols):
            if c >= len(row):
                raise DataError(f"{src._where}.{field}: {path} line {lineno} has {len(row)} columns, "
                                f"no column {getattr(src, field)!r}")
        try:
            score = float(row[cols[2]])
        except ValueError:
            score = math.nan
        if not math.isfinite(score):
            raise DataError(f"{src._where}.score: {path} line {lineno}: score {row[cols[2]]!r} is not a finite number")
        out.append(Pair(row[cols[0]].strip(), row[cols[1]].strip(), score))
    return out


def claims(src) -> list[Claim]:
    return [Claim(files(src)[0].resolve(), UNIT, src.split)]


def describe(src) -> str:
    return (f"sentence pairs {src.path} (texts {src.text_a!r}, {src.text_b!r}; score {src.score!r}), "
            f"rows {src.split}")
