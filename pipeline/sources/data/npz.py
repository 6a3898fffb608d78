"""Ready input feeds in a ``.npz`` file: one array per graph input, keyed by the
input's name, first axis = sample; optionally a labels array (named by
``labels``) with the same first axis. The range counts samples."""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from pipeline.sources.data.base import Claim, DataError, Labeled, resolve, select

UNIT = "sample"


def files(src) -> list[Path]:
    return [resolve(src, src.path, "path")]


def _load(src, path: Path) -> dict[str, np.ndarray]:
    if not zipfile.is_zipfile(path):
        raise DataError(f"{src._where}.path: {path} is not an .npz file (not a zip archive); "
                        f"valid: numpy.savez output")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise DataError(f"{src._where}.path: {path} is not an .npz file ({e}); valid: numpy.savez output") from None
    except ValueError as e:  # object arrays need pickle, which is never enabled for data files
        raise DataError(f"{src._where}.path: {path}: {e}; valid: numeric or string arrays") from None


def arrays(src, inputs=None) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """``(feeds, labels)`` for samples ``src.split``: ``feeds`` maps each input
    name to its array ``[n, ...]`` (dtype as stored); ``labels`` is ``[n, ...]``
    or None without ``labels``.

    Args:
        inputs: the graph input names the model needs (each must be in the
            file; only these are returned), or None for every array but the labels.

    Raises:
        DataError: the file is not an npz, lacks an input or the labels array,
            has no feed arrays, an array has no sample axis or a different sample
            count, or the split is empty or reaches past the samples.
    """
    path = files(src)[0]
    data = _load(src, path)
    labels = None
    if src.labels is not None:
        if src.labels not in data:
            raise DataError(f"{src._where}.labels: {path} has no array {src.labels!r} (arrays: {sorted(data)})")
        labels = data.pop(src.labels)
    names = list(data) if inputs is None else list(inputs)
    for name in names:
        if name not in data:
            raise DataError(f"{src._where}.path: {path} has no array for graph input {name!r} "
                            f"(arrays: {sorted(data)}); valid: one array per input, keyed by its name")
    if not names:
        raise DataError(f"{src._where}.path: {path} holds no feed arrays; valid: one array per graph input")
    picked = {n: data[n] for n in names} | ({src.labels: labels} if labels is not None else {})
    counts = {n: a.shape[0] for n, a in picked.items() if a.ndim}
    if len(counts) < len(picked) or len(set(counts.values())) > 1:
        shapes = {n: (a.shape[0] if a.ndim else "no axis") for n, a in picked.items()}
        raise DataError(f"{src._where}.path: {path}: arrays need the same first (sample) axis; got {shapes}")
    start, stop = select(src, next(iter(counts.values())), UNIT, str(path))
    return {n: data[n][start:stop] for n in names}, (labels[start:stop] if labels is not None else None)


def items(src, inputs=None) -> list[Labeled]:
    """One ``Labeled(feed, label)`` per sample of ``src.split``: ``feed`` maps
    each input name to that sample's array (sample axis removed); ``label`` is
    the sample's label (None without ``labels``). See :func:`arrays` for
    ``inputs`` and errors."""
    feeds, labels = arrays(src, inputs)
    n = len(next(iter(feeds.values())))
    return [Labeled({k: v[i] for k, v in feeds.items()}, None if labels is None else labels[i]) for i in range(n)]


def claims(src) -> list[Claim]:
    return [Claim(files(src)[0].resolve(), UNIT, src.split)]


def describe(src) -> str:
    label = f", labels {src.labels!r}" if src.labels else ""
    return f"npz feeds {src.path}{label}, samples {src.split}"
