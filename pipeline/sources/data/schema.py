"""Recipe schema of the data sources: one discriminated union on ``type``.

```yaml
data: {type: corpus, name: lee_background, split: {start: 220, stop: 300}}
data: {type: text, path: data/news.txt, split: {start: 0, stop: 500}}
data: {type: jsonl, path: data/reviews.jsonl, field: text, label_field: stars}
data: {type: pairs, path: data/sts.tsv, text_a: sentence1, text_b: sentence2, score: score}
data: {type: images, path: data/images, split: {start: 0, stop: 100}}
data: {type: npz, path: data/feeds.npz, labels: labels}
```

``split`` is a half-open range ``[start, stop)`` of the source's records
(documents, records, rows, images, samples; ``stop`` omitted: to the end).
Relative paths are read from the recipe file's folder: a source validated with
``context={"base_dir": folder}`` (or made by :func:`pipeline.sources.data.load`)
is bound to it.

Every source has ``files()``, ``sha256()``, ``items()``, ``describe()``,
``claims()`` (for :func:`pipeline.sources.data.check_disjoint`) and
``record_kind``: what ``items()`` returns.
"""
from __future__ import annotations

import abc

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, PrivateAttr, model_validator

import pipeline.sources.data.corpus as corpus
import pipeline.sources.data.images as images
import pipeline.sources.data.jsonl as jsonl
import pipeline.sources.data.npz as npz
import pipeline.sources.data.pairs as pairs
import pipeline.sources.data.text as text
from pipeline.sources.data.base import Claim, Range, RecipeBound, Strict, files_sha256

RecordKind = Literal["documents", "labeled_documents", "pairs", "images", "feeds"]


class _Source(Strict, RecipeBound, abc.ABC):
    """Shared behaviour; each subclass says which reader module implements it."""

    split: Range = Field(Range(start=0, stop=None), description="records [start, stop) to use; default all")
    _where: str = PrivateAttr("data")

    @abc.abstractmethod
    def _reader(self):
        """The module-level reader of this source type (``pipeline.sources.data.<type>``)."""

    def files(self) -> list[Path]:
        """The files this source reads (absolute or recipe-relative, as resolved).

        Raises:
            DataError: a file or folder is missing (names the field and the path).
        """
        return self._reader().files(self)

    def sha256(self) -> str:
        """Content hash (hex) of :meth:`files`, streamed: a single file's own sha256;
        for a folder, the hash of each file's relative path and sha256.

        Raises:
            DataError: as :meth:`files`.
        """
        return files_sha256(self.files(), self.location())

    def location(self) -> Path:
        """The file (or, for images, the folder) the manifest names for this source.

        Raises:
            DataError: as :meth:`files`.
        """
        return self.files()[0]

    def items(self) -> list:
        """The records of ``split``, as :attr:`record_kind` says.

        Raises:
            DataError: the data is missing or malformed, or the range is empty or
                reaches past it; the message names the field, file and line.
        """
        return self._reader().items(self)

    def claims(self) -> list[Claim]:
        """Which files and ranges this use reads, for the overlap check."""
        return self._reader().claims(self)

    def describe(self) -> str:
        """One line for people: type, file and range."""
        return self._reader().describe(self)

    def packages(self) -> tuple[str, ...]:
        """Import names of the installed Python packages whose files this source reads (never
        imported): what another runner must install (:func:`pipeline.sources.needs.source_needs`)."""
        return ()

    def local_paths(self) -> dict[str, str]:
        """``{field: value as given}`` of the paths on this machine the source reads."""
        path = getattr(self, "path", None)
        return {"path": path} if isinstance(path, str) else {}

    @property
    @abc.abstractmethod
    def record_kind(self) -> RecordKind:
        """What :meth:`items` returns: ``documents`` (``list[str]``),
        ``labeled_documents`` (``list[Labeled(str, label)]``), ``pairs``
        (``list[Pair]``), ``images`` (``list[Labeled(Path, int)]``) or
        ``feeds`` (``list[Labeled(dict[str, ndarray], label)]``)."""


class CorpusSource(_Source):
    """A built-in corpus from the gensim wheel's test data."""

    type: Literal["corpus"] = Field(description="selects this source type")
    name: Literal["lee_background", "wordsim353", "simlex999"] = Field(
        description="lee_background: documents; wordsim353 / simlex999: scored word pairs")

    def _reader(self):
        return corpus

    def packages(self) -> tuple[str, ...]:
        return (corpus.PACKAGE,)

    @property
    def record_kind(self) -> RecordKind:
        return "documents" if self.name in corpus.CORPORA else "pairs"


class TextSource(_Source):
    """A UTF-8 text file, one document per non-blank line."""

    type: Literal["text"] = Field(description="selects this source type")
    path: str = Field(min_length=1, description="the text file")

    def _reader(self):
        return text

    @property
    def record_kind(self) -> RecordKind:
        return "documents"


class JsonlSource(_Source):
    """A JSONL file; the text is in ``field``, an optional label in ``label_field``."""

    type: Literal["jsonl"] = Field(description="selects this source type")
    path: str = Field(min_length=1, description="the JSONL file")
    field: str = Field(min_length=1, description="key of the text in each record")
    label_field: str | None = Field(None, min_length=1, description="key of the label in each record; none: unlabeled")

    def _reader(self):
        return jsonl

    @property
    def record_kind(self) -> RecordKind:
        return "documents" if self.label_field is None else "labeled_documents"


Column = Union[Annotated[int, Field(ge=0)], Annotated[str, Field(min_length=1)]]


class PairsSource(_Source):
    """A CSV/TSV of sentence pairs with a gold score; columns by header name or 0-based index."""

    type: Literal["pairs"] = Field(description="selects this source type")
    path: str = Field(min_length=1, description="the CSV / TSV file")
    text_a: Column = Field(0, description="column of the first sentence (header name or 0-based index)")
    text_b: Column = Field(1, description="column of the second sentence")
    score: Column = Field(2, description="column of the gold similarity score")
    header: bool = Field(True, description="the first non-blank row names the columns")
    delimiter: str | None = Field(None, min_length=1, max_length=1,
                                  description="default: ',' for .csv, tab for .tsv/.tab")

    @model_validator(mode="after")
    def _columns(self) -> "PairsSource":
        cols = [self.text_a, self.text_b, self.score]
        if not self.header and any(isinstance(c, str) for c in cols):
            raise ValueError("columns given by name need header: true; without a header give 0-based indices")
        if len(set(cols)) < 3:
            raise ValueError(f"text_a, text_b and score must be three different columns, got {cols}")
        return self

    def _reader(self):
        return pairs

    @property
    def record_kind(self) -> RecordKind:
        return "pairs"


class ImagesSource(_Source):
    """A folder of PNG/JPEG images in one subfolder per label (sorted names = class indices)."""

    type: Literal["images"] = Field(description="selects this source type")
    path: str = Field(min_length=1, description="folder with one subfolder of images per label")

    def _reader(self):
        return images

    def location(self) -> Path:
        return images.root(self)

    def classes(self) -> list[str]:
        """Label names by class index (sorted subfolder names).

        Raises:
            DataError: the folder is missing or has no subfolder.
        """
        return images.classes(self)

    @property
    def record_kind(self) -> RecordKind:
        return "images"


class NpzSource(_Source):
    """Ready input feeds: arrays keyed by graph input name, first axis = sample."""

    type: Literal["npz"] = Field(description="selects this source type")
    path: str = Field(min_length=1, description="the .npz file of arrays keyed by graph input name")
    labels: str | None = Field(None, min_length=1, description="name of the labels array in the file")

    def _reader(self):
        return npz

    def items(self, inputs=None) -> list:
        """Per-sample feeds; ``inputs``: the graph input names required (see :func:`npz.arrays`)."""
        return npz.items(self, inputs)

    def arrays(self, inputs=None):
        """``(feeds {name: [n, ...]}, labels [n, ...] | None)`` of ``split`` (see :func:`npz.arrays`)."""
        return npz.arrays(self, inputs)

    @property
    def record_kind(self) -> RecordKind:
        return "feeds"


DataSource = Annotated[
    Union[CorpusSource, TextSource, JsonlSource, PairsSource, ImagesSource, NpzSource],
    Field(discriminator="type"),
]
"""The one data-source type of the recipe (calibration, validation, bench)."""
