"""Built-in corpora, read from the test data that the gensim wheel ships.

* ``lee_background``: 300 news articles, one per line (Lee et al., 2005);
  records are documents (non-blank lines, stripped).
* ``wordsim353``, ``simlex999``: word pairs with human similarity scores;
  records are :class:`~pipeline.sources.data.base.Pair` (``#`` lines skipped).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from pipeline.sources.data.base import Claim, DataError, Pair, documents, read_text, select

CORPORA = {"lee_background": "lee_background.cor"}
WORD_SIM = {"wordsim353": "wordsim353.tsv", "simlex999": "simlex999.txt"}
FILES = {**CORPORA, **WORD_SIM}
#: the package whose wheel ships them (its files are read; it is never imported)
PACKAGE = "gensim"


def test_data_dir() -> Path:
    """gensim's ``test/test_data`` folder, found without importing gensim.

    Raises:
        DataError: gensim is not installed.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the gensim package (it ships the built-in corpora) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data"


def unit(src) -> str:
    return "document" if src.name in CORPORA else "word pair"


def files(src) -> list[Path]:
    path = test_data_dir() / FILES[src.name]
    if not path.is_file():
        raise DataError(f"{src._where}.name: built-in corpus {src.name!r} is missing from the gensim wheel ({path})")
    return [path]


def _word_pairs(src, path: Path) -> list[Pair]:
    out = []
    for line in read_text(src, path).splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        a, b, s = line.split("\t")[:3]
        out.append(Pair(a, b, float(s)))
    return out


def items(src) -> list:
    """Documents (``list[str]``) or word pairs (``list[Pair]``) of ``src.split``.

    Raises:
        DataError: gensim is missing, or the split reaches past the corpus.
    """
    path = files(src)[0]
    records = documents(read_text(src, path)) if src.name in CORPORA else _word_pairs(src, path)
    start, stop = select(src, len(records), unit(src), path.name)
    return records[start:stop]


def claims(src) -> list[Claim]:
    return [Claim(files(src)[0].resolve(), unit(src), src.split)]


def describe(src) -> str:
    return f"built-in corpus {src.name}, {unit(src)}s {src.split}"
