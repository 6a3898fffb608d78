"""Adapter parts shared by several kinds (no kind is tested here)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeline.runners import base as runners
from pipeline.sources.model import load_tokenizer


class OnnxRuntimeRunners:
    """The default reference / candidate runners of :class:`pipeline.models.base.ModelAdapter`:
    the FP32 export in ONNX Runtime against the optimized graph in ONNX Runtime, or the
    TensorRT engine where one was built."""

    def reference_runner(self, exp) -> runners.Runner:
        """The FP32 graph ``exp.onnx_path`` in ONNX Runtime."""
        return runners.OrtRunner(exp.onnx_path, name="fp32 (onnxruntime)")

    def candidate_runner(self, q, engine: str | None = None) -> runners.Runner:
        """The engine at ``engine`` (:func:`pipeline.runners.base.tensorrt_runner`), else ``q``'s graph in ONNX Runtime.

        Raises:
            RunnerError: the engine does not load.
        """
        if engine:
            return runners.tensorrt_runner(engine)
        return runners.OrtRunner(q.ort_path, name=f"{q.precision} (onnxruntime)",
                                  user_graph=not q.quantized_nodes)  # no Q/DQ: the exported graph


class SourceFiles:
    """The default source-file members of :class:`pipeline.models.base.ModelAdapter`: the
    kind needs nothing from its source beyond the weights, and its processor is saved
    with ``save_pretrained``."""

    def check_files(self) -> None:
        """Nothing to check beyond the weights."""

    def check_recipe(self, recipe) -> list[str]:
        """Nothing of the source to check against the recipe: no warnings."""
        return []

    def save_processor(self, loaded, folder) -> None:
        """``loaded.processor.save_pretrained(folder)``."""
        loaded.processor.save_pretrained(str(folder))


def text_batches(exp, data, cal, feeds_for_ids: Callable[[object, np.ndarray], dict[str, np.ndarray]]
                 ) -> list[dict[str, np.ndarray]]:
    """Calibration batches of token windows for text kinds.

    Up to ``cal.samples`` windows of ``cal.seq_len`` tokens from the documents of
    ``data`` (:func:`pipeline.models.text.token_windows` with the exported tokenizer), in
    batches of ``cal.batch_size`` rows, each turned into graph feeds by
    ``feeds_for_ids(exp, ids)`` (ids int64 ``[rows, cal.seq_len]``).

    Raises:
        DataError: ``data`` does not hold documents.
    """
    from pipeline.models import text as text_data

    docs = text_data.documents(data)
    tok = load_tokenizer(exp.tokenizer_dir)
    windows = text_data.token_windows(tok, docs, cal.seq_len, cal.samples)
    return [feeds_for_ids(exp, windows[i : i + cal.batch_size]) for i in range(0, len(windows), cal.batch_size)]
