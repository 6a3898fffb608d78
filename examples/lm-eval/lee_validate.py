"""The documents of lee_validate.yaml: lines 220-299 of gensim's ``lee_background.cor`` (non-blank
lines, stripped), the split ``recipes/fp8-llm.yaml``'s ``validate.data`` names."""
from __future__ import annotations

import importlib.util
from pathlib import Path

START, STOP = 220, 300


def load(**metadata):
    """``{"test": Dataset}`` of ``{"text": document}`` rows (lm-eval's ``custom_dataset``; the task's
    ``metadata`` is passed in and not used). Raises ModuleNotFoundError without gensim."""
    import datasets

    spec = importlib.util.find_spec("gensim")  # its test data, without importing gensim
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("lee_validate needs the gensim package (it ships the Lee corpus)")
    path = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / "lee_background.cor"
    lines = [line.strip() for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"text": t} for t in lines[START:STOP]])})
