"""Model adapters: how each model kind is loaded, exported and fed."""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """Silence the exporter's deprecation chatter and step banners; errors still raise.

    Use with ``torch.onnx.export(..., dynamo=True)``; sets ``verbose=False`` style
    output by muting torch.onnx's logger and Python warnings inside the block.
    """
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(None):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
