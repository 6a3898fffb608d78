"""Labelled graph feeds for the classifier from a data source (``images`` or ``npz``)."""
from __future__ import annotations

import numpy as np

from pipeline.sources.data import DataError
from pipeline.models.image_classification import preprocess


def labelled_inputs(data, input_name: str, limit: int | None = None,
                    size: tuple[int, int] = (preprocess.HEIGHT, preprocess.WIDTH)) -> tuple[np.ndarray, np.ndarray | None]:
    """``(x float32 [n, 3, H, W], labels int64 [n] | None)`` from ``data``.

    ``images`` sources are decoded and preprocessed (:func:`preprocess.normalize`;
    labels are the class indices of the sorted subfolder names, which must be
    the model's class order); ``npz`` sources give the array named ``input_name``
    as stored. ``limit``: at most this many samples, taken evenly across the
    source's order (an image folder lists one class after the other).

    Raises:
        DataError: another record kind, an npz array that is not [n, 3, H, W],
            or an image Pillow cannot decode.
    """
    if data.record_kind == "images":
        items = _spread(data.items(), limit)
        try:
            x = preprocess.batch((data._reader().load_image(data, p) for p, _ in items), *size)
        except ValueError as e:
            raise DataError(f"{data._where}: {e}") from None
        return x, np.array([label for _, label in items], np.int64)
    if data.record_kind == "feeds":
        feeds, labels = data.arrays([input_name])
        x = np.asarray(feeds[input_name], np.float32)
        if x.ndim != 4 or x.shape[1] != 3:
            raise DataError(f"{data._where}.path: array {input_name!r} has shape {list(x.shape)}; "
                            f"valid: [n, 3, height, width] float32")
        keep = _spread(list(range(len(x))), limit)
        return x[keep], (None if labels is None else np.asarray(labels, np.int64).reshape(-1)[keep])
    raise DataError(f"{data._where}: an image classifier reads images or npz feeds; {data.describe()} "
                    f"holds {data.record_kind}")


def _spread(items: list, limit: int | None) -> list:
    if limit is None or len(items) <= limit:
        return list(items)
    picks = np.linspace(0, len(items) - 1, limit).round().astype(int)
    return [items[i] for i in picks]


def batches(x: np.ndarray, input_name: str, size: int) -> list[dict[str, np.ndarray]]:
    """Feeds of at most ``size`` rows each, in order."""
    return [{input_name: x[i:i + size]} for i in range(0, len(x), size)]
