"""A UTF-8 text file, one document per line (blank lines are not documents)."""
from __future__ import annotations

from pathlib import Path

from pipeline.sources.data.base import Claim, documents, read_text, resolve, select

UNIT = "document"  # the same unit as the built-in lee_background corpus


def files(src) -> list[Path]:
    return [resolve(src, src.path, "path")]


def items(src) -> list[str]:
    """Documents ``src.split`` of the file: non-blank lines, stripped.

    Raises:
        DataError: the file is missing or not UTF-8, or the split is empty or
            reaches past the file.
    """
    path = files(src)[0]
    docs = documents(read_text(src, path))
    start, stop = select(src, len(docs), UNIT, str(path))
    return docs[start:stop]


def claims(src) -> list[Claim]:
    return [Claim(files(src)[0].resolve(), UNIT, src.split)]


def describe(src) -> str:
    return f"text file {src.path}, documents {src.split}"
