"""Feed batches on disk: the calibration feeds the quantize stage hands forward.

A batch is a feed dict (graph input name -> numpy array, batch on axis 0). A
list of batches is stored in one ``.npz`` as ``"<index>/<input name>"`` arrays,
read back bit-identical in the same order (names sorted within a batch is not
assumed: the stored order is kept).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError
from pipeline.fsutil import write_atomic


def save_batches(path: str | Path, batches: list[dict[str, np.ndarray]]) -> Path:
    """Write ``batches`` to ``path`` (``.npz``, uncompressed) atomically; returns ``path``."""
    path = Path(path)
    arrays = {f"{i}/{name}": array for i, batch in enumerate(batches) for name, array in batch.items()}
    write_atomic(path, lambda fh: np.savez(fh, **arrays))
    return path


def load_batches(path: str | Path) -> list[dict[str, np.ndarray]]:
    """The batches written by :func:`save_batches`, in order.

    Raises:
        PipelineError: the file is missing or not such an archive (re-run the quantize stage).
    """
    try:
        with np.load(path, allow_pickle=False) as archive:
            batches: dict[int, dict[str, np.ndarray]] = {}
            for key in archive.files:
                index, _, name = key.partition("/")
                batches.setdefault(int(index), {})[name] = archive[key]
    except (OSError, ValueError) as e:
        raise PipelineError(f"{path}: cannot read the calibration feeds ({e}); re-run the quantize stage") from e
    return [batches[i] for i in sorted(batches)]
