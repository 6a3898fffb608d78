"""Feeds for a generic model: random ones at a shape point, and recorded ones from data.

Data sources the generic kind reads (``quantize.calibration.data``, ``validate.data``):

* ``npz``: one array per graph input, keyed by the input's name, sample on axis 0
  (``numpy.savez(path, x=[n, ...], mask=[n, ...])``);
* ``jsonl`` of numeric rows: ``field`` names the key holding an object with one
  nested list of numbers per graph input, for ONE sample (no batch axis), e.g.
  ``{"inputs": {"x": [[0.1, 0.2], [0.3, 0.4]], "mask": [1, 1]}, "text": "..."}``
  with ``field: inputs``. Other keys are ignored. Every record gives each input
  the same shape, so samples stack into batches.

Values are cast to the graph input's dtype (ints to int64 / int32, numbers to float32 ...).
"""
from __future__ import annotations

import json

import numpy as np

from pipeline.artifacts import TensorSpec
from pipeline.sources.data.base import DataError, read_text, select
from pipeline.errors import ExportError

Feeds = dict[str, np.ndarray]


def random_feeds(inputs: list[TensorSpec], point: dict[str, int], seed: int) -> Feeds:
    """Valid random feeds at one shape point: float inputs standard normal, inputs named
    ``*mask*`` ones, other integer inputs in ``[0, 2)`` (any embedding table holds 0 and 1),
    bool inputs True. Deterministic in ``seed``.

    Args:
        inputs: graph inputs; ``shape`` entries are fixed ints or dim names.
        point: dim name -> size.

    Raises:
        ExportError: a dim of an input is neither fixed nor in ``point`` (names both).
    """
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in inputs:
        shape = []
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, str):
                if dim not in point:
                    raise ExportError(f"export.check_points: input {spec.name!r} axis {axis} is the dynamic dim "
                                      f"{dim!r}, which the point {point} does not size; add {dim}: <size>")
                shape.append(point[dim])
            elif dim < 1:
                raise ExportError(f"export: input {spec.name!r} axis {axis} has no size and no name in the graph; "
                                  "name it in export.dynamic_axes")
            else:
                shape.append(dim)
        dtype = np.dtype(spec.dtype)
        if dtype == np.bool_:
            feeds[spec.name] = np.ones(shape, np.bool_)
        elif np.issubdtype(dtype, np.integer):
            feeds[spec.name] = (np.ones(shape, dtype) if "mask" in spec.name.lower()
                                else rng.integers(0, 2, shape).astype(dtype))
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def samples(data, inputs: list[TensorSpec], limit: int | None = None) -> Feeds:
    """The samples of ``data``'s range as stacked feeds ``{input: [n, ...]}`` in each input's
    dtype, at most ``limit`` of them.

    Raises:
        DataError: ``data`` is neither npz nor jsonl; a record is not JSON, lacks the
            field or an input, holds non-numbers or a shape unlike the first record's
            (names the file, line and input); no sample.
    """
    names = [s.name for s in inputs]
    if data.record_kind == "feeds":
        arrays, _ = data.arrays(names)
    elif getattr(data, "type", None) == "jsonl":
        arrays = _jsonl_rows(data, names, limit)
    else:
        raise DataError(f"{data._where}: a generic model reads recorded feeds from an npz file or a jsonl file of "
                        f"numeric rows; {data.describe()} holds {data.record_kind}")
    dtypes = {s.name: np.dtype(s.dtype) for s in inputs}
    out = {n: _cast(np.asarray(a[:limit] if limit is not None else a), dtypes[n], n, data)
           for n, a in arrays.items()}
    if not len(next(iter(out.values()))):
        raise DataError(f"{data._where}: {data.describe()} gives no sample")
    return out


def _cast(array: np.ndarray, dtype: np.dtype, name: str, data) -> np.ndarray:
    """``array`` in the graph input's ``dtype``; values an integer input cannot hold exactly
    (a fraction, or beyond its range) are refused, never truncated.

    Raises:
        DataError: names the input, the data and the first such value.
    """
    if array.dtype.kind not in "biuf":  # strings or objects: numpy would parse "84.0" as a number, silently
        raise DataError(f"{data._where}: {data.describe()}: input {name!r} holds {array.dtype} values, which are not "
                        f"{dtype}; valid: numbers (or true/false)")
    if dtype.kind == "b" and array.dtype.kind != "b" and not np.isin(array, (0, 1)).all():
        raise DataError(f"{data._where}: {data.describe()}: input {name!r} is bool in the graph, but holds "
                        f"{array[~np.isin(array, (0, 1))].flat[0].item()!r}; valid: true/false or 0/1")
    if np.issubdtype(dtype, np.integer) and array.size and array.dtype.kind in "fiu":
        info = np.iinfo(dtype)
        wide = array.astype(np.float64) if array.dtype.kind == "f" else array
        bad = (wide < info.min) | (wide > info.max)
        if array.dtype.kind == "f":
            bad |= ~np.isfinite(wide) | (wide != np.round(wide))
        if bad.any():
            raise DataError(f"{data._where}: {data.describe()}: input {name!r} is {dtype} in the graph, but holds "
                            f"{array[bad].flat[0].item()!r}; valid: whole numbers in [{info.min}, {info.max}]")
    return array.astype(dtype, copy=False)


def _jsonl_rows(data, names: list[str], limit: int | None) -> Feeds:
    path = data.files()[0]
    lines = [(n, line) for n, line in enumerate(read_text(data, path).split("\n"), 1) if line.strip()]
    start, stop = select(data, len(lines), "record", str(path))
    picked = lines[start:stop][:limit] if limit is not None else lines[start:stop]
    rows: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for lineno, line in picked:
        where = f"{data._where}.field: {path} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{data._where}.path: {path} line {lineno}: not JSON ({e.msg}, column {e.colno})") from None
        feeds = obj.get(data.field) if isinstance(obj, dict) else None
        if not isinstance(feeds, dict):
            raise DataError(f"{where}: {data.field!r} must hold an object of one nested list per graph input "
                            f"({names}), e.g. {{{data.field!r}: {{{names[0]!r}: [[0.1, 0.2]]}}}}")
        for name in names:
            if name not in feeds:
                raise DataError(f"{where}: {data.field!r} has no graph input {name!r} (it has {sorted(feeds)})")
            kinds = _leaf_kinds(feeds[name])
            if not kinds <= {"number", "bool"} or kinds == {"number", "bool"}:
                raise DataError(f"{where}: input {name!r} holds a value that is not a JSON number (a string or "
                                "null, or true/false among numbers); valid: numbers only, or true/false only")
            dtype = np.bool_ if kinds == {"bool"} else np.float64 if _has_float(feeds[name]) else np.int64
            try:
                value = np.asarray(feeds[name], dtype=dtype)
            except (ValueError, TypeError):
                raise DataError(f"{where}: input {name!r} is not a rectangular nested list of numbers") from None
            except OverflowError:
                raise DataError(f"{where}: input {name!r} holds an integer beyond int64") from None
            if rows[name] and value.shape != rows[name][0].shape:
                raise DataError(f"{where}: input {name!r} has shape {list(value.shape)}, the first record "
                                f"{list(rows[name][0].shape)}; every record needs the same shape (pad them)")
            rows[name].append(value)
    return {n: np.stack(v) if v else np.zeros((0,)) for n, v in rows.items()}


def _leaf_kinds(value) -> set[str]:
    """What the leaves of a nested list are: ``number``, ``bool`` (not a number, though Python
    counts it as int) or ``other``."""
    if isinstance(value, list):
        return set().union(*(_leaf_kinds(v) for v in value)) if value else set()
    return {"bool"} if isinstance(value, bool) else {"number"} if isinstance(value, (int, float)) else {"other"}


def _has_float(value) -> bool:
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    return isinstance(value, float)


def batches(feeds: Feeds, batch_size: int) -> list[Feeds]:
    """``feeds`` ``{input: [n, ...]}`` cut into batches of ``batch_size`` rows (the last may be smaller)."""
    n = len(next(iter(feeds.values())))
    return [{k: v[i : i + batch_size] for k, v in feeds.items()} for i in range(0, n, batch_size)]
