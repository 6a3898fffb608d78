"""What every data source shares: its error type, record types, path
resolution against the recipe folder, range selection and file hashing.

Imports nothing from the rest of the pipeline but ``errors`` and ``fsutil``'s
hashing, so the source schema and the recipe stand on it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, model_validator

from pipeline.errors import InternalError, PipelineError
from pipeline.fsutil import sha256_file, user_path


class DataError(PipelineError):
    """Eval, calibration or bench data is missing, malformed, too small for the
    recipe, or overlaps another use (exit 2)."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Range(Strict):
    """Half-open range ``[start, stop)`` of records; ``stop`` None: to the end."""

    start: int = Field(0, ge=0, description="first record used (0-based)")
    stop: int | None = Field(None, gt=0, description="first record not used; none: to the end")

    @model_validator(mode="after")
    def _ordered(self) -> "Range":
        if self.stop is not None and self.stop <= self.start:
            raise ValueError(f"stop ({self.stop}) must be greater than start ({self.start})")
        return self

    def overlaps(self, other: "Range") -> bool:
        """True when the two ranges share a record (an open end reaches every later one)."""
        return ((self.stop is None or other.start < self.stop)
                and (other.stop is None or self.start < other.stop))

    def __str__(self) -> str:
        return f"[{self.start}, {'end' if self.stop is None else self.stop})"


class Pair(NamedTuple):
    """Two texts and their gold similarity score (any scale; Spearman only ranks it)."""

    text_a: str
    text_b: str
    score: float


class Labeled(NamedTuple):
    """One input and its label: ``(text, JSON scalar)`` for JSONL,
    ``(image Path, class index)`` for images, ``(feed dict, label array | None)`` for npz."""

    input: Any
    label: Any


class Claim(NamedTuple):
    """What a use of a source reads from one file, for the overlap check:
    the resolved file, the unit its range counts and the range (None: all of it)."""

    path: Path
    unit: str
    range: Range | None


def resolve(src, value: str, field: str, *, folder: bool = False) -> Path:
    """``value`` (a recipe path) as a path: absolute as given, else relative to the
    folder of the recipe the source was bound to.

    Raises:
        DataError: the file (or folder) does not exist; names ``<where>.<field>``.
        InternalError: a relative path on a source never bound to a recipe folder.
    """
    path = Path(user_path(value))
    if not path.is_absolute():
        if src._base_dir is None:
            raise InternalError(f"{src._where}.{field}: relative path {value!r} on a source not bound to a recipe "
                                f"folder; use pipeline.sources.data.load(spec, base_dir)")
        path = Path(src._base_dir) / path
    ok = path.is_dir() if folder else path.is_file()
    if not ok:
        what = "folder" if folder else "file"
        raise DataError(f"{src._where}.{field}: {what} {path} not found (relative paths are read from the recipe's "
                        f"folder {src._base_dir})")
    return path


def select(src, count: int, unit: str, name: str) -> tuple[int, int]:
    """The ``[start, stop)`` that ``src.split`` picks from ``count`` records.

    Raises:
        DataError: the range reaches past the data or picks nothing; names
            ``<where>.split``, the file and the valid bound.
    """
    r = src.split
    stop = count if r.stop is None else r.stop
    if stop > count:
        raise DataError(f"{src._where}.split: split {r} reaches past the {count} {unit}s of {name}; "
                        f"valid: stop <= {count}")
    if r.start >= stop:
        valid = f"start < {stop}" if count else f"a {name} with at least one {unit}"
        raise DataError(f"{src._where}.split: split {r} of {name} is empty ({count} {unit}s); valid: {valid}")
    return r.start, stop


def files_sha256(files: list[Path], root: Path) -> str:
    """sha256 hex of the data: the file's own sha256 for one file equal to ``root``,
    else the sha256 of ``"<path relative to root>:<file sha256>\\n"`` lines in the
    order given (names count: an image's folder is its label). Streams each file.
    """
    if len(files) == 1 and files[0] == root:
        return sha256_file(files[0])
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(root).as_posix()}:{sha256_file(f)}\n".encode())
    return h.hexdigest()


def read_text(src, path: Path) -> str:
    """A UTF-8 file's text, without a leading byte-order mark (Windows editors write one).

    Raises:
        DataError: the file cannot be read or is not UTF-8 (names the byte offset).
    """
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{src._where}.path: {path} is not UTF-8 text (byte {e.start}); valid: a UTF-8 file") from None
    except OSError as e:
        raise DataError(f"{src._where}.path: cannot read {path}: {e.strerror}") from None


def documents(text: str) -> list[str]:
    """Non-blank lines, stripped: one document per line (``str.splitlines`` rules,
    exactly as the built-in corpus has always been read)."""
    return [line.strip() for line in text.splitlines() if line.strip()]


class RecipeBound(BaseModel):
    """A recipe part that reads files: relative paths resolve against the recipe's
    folder (``context={"base_dir": ...}`` at validation, or :meth:`bind`) and errors
    name the recipe key ``_where`` (each subclass sets its default)."""

    _base_dir: Path | None = PrivateAttr(None)
    _where: str = PrivateAttr("")

    @model_validator(mode="after")
    def _bind_from_context(self, info: ValidationInfo):
        if info.context and info.context.get("base_dir") is not None:
            self._base_dir = Path(info.context["base_dir"])
        return self

    def bind(self, base_dir: str | Path | None, where: str | None = None):
        """A copy whose relative paths resolve against ``base_dir`` and whose errors
        name the recipe key ``where`` (default: this one's)."""
        out = self.model_copy()
        out._base_dir = Path(base_dir) if base_dir is not None else None
        out._where = where if where is not None else self._where
        return out
