"""Real text data shipped in the gensim wheel, split into disjoint document ranges.

* ``lee_background.cor``: 300 news articles, one per line (Lee et al., 2005).
* ``wordsim353.tsv``, ``simlex999.txt``: word pairs with human similarity scores.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError
from pipeline.recipe import Split

CORPORA = {"lee_background": "lee_background.cor"}
WORD_SIM = {"wordsim353": "wordsim353.tsv", "simlex999": "simlex999.txt"}


class DataError(PipelineError):
    """Eval or calibration data is missing or too small for the recipe."""


def test_data_dir() -> Path:
    """gensim's ``test/test_data`` folder, found without importing gensim."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the gensim package (it ships the eval corpora) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data"


def load_documents(dataset: str, split: Split) -> list[str]:
    """Documents ``[split.start, split.stop)`` of a corpus, stripped.

    Raises:
        DataError: the split reaches past the corpus end.
    """
    path = test_data_dir() / CORPORA[dataset]
    docs = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if split.stop > len(docs):
        raise DataError(f"split [{split.start}, {split.stop}) reaches past the {len(docs)} documents of {path.name}")
    return docs[split.start : split.stop]


def token_windows(tokenizer, docs: list[str], seq_len: int, max_windows: int) -> np.ndarray:
    """Concatenate documents (EOS between them) and cut fixed windows.

    Returns int64 ``[n, seq_len]`` with ``n <= max_windows``; a trailing
    partial window is dropped.
    """
    sep = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + ([sep] if sep is not None else [])
        if len(ids) >= seq_len * max_windows:
            break
    n = min(len(ids) // seq_len, max_windows)
    return np.asarray(ids[: n * seq_len], np.int64).reshape(n, seq_len)


def prompts(tokenizer, docs: list[str], count: int, prompt_len: int = 16) -> np.ndarray:
    """The first ``prompt_len`` tokens of ``count`` documents: int64 ``[count, prompt_len]``.

    Raises:
        DataError: fewer usable documents than ``count``.
    """
    rows = []
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_len:
            rows.append(ids[:prompt_len])
        if len(rows) == count:
            return np.asarray(rows, np.int64)
    raise DataError(f"need {count} prompts of {prompt_len} tokens, the split has {len(rows)}")


def word_pairs(name: str) -> tuple[list[tuple[str, str]], np.ndarray]:
    """Word pairs and human scores (float64 ``[n]``) of a word-similarity set."""
    pairs, scores = [], []
    for line in (test_data_dir() / WORD_SIM[name]).read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        a, b, s = line.split("\t")[:3]
        pairs.append((a, b))
        scores.append(float(s))
    return pairs, np.asarray(scores)
