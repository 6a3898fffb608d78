"""The one mapping of ``model.kind`` to its adapter (:class:`pipeline.models.base.ModelAdapter`).

Every kind of :data:`pipeline.recipe.schema.ModelKind` has an entry (tests check the two
agree), so the schema refuses an unknown kind and no kind falls back to another.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.models.base import ModelAdapter
    from pipeline.recipe.schema import ModelSource

#: kind -> "module:class" of its adapter.
ADAPTERS = {
    "text-generation": "pipeline.models.text_generation.adapter:TextGenerationAdapter",
    "sentence-embedding": "pipeline.models.sentence_embedding.adapter:SentenceEmbeddingAdapter",
    "image-classification": "pipeline.models.image_classification.adapter:ImageClassificationAdapter",
    "generic": "pipeline.models.generic.adapter:GenericAdapter",
}


def adapter_class(kind: str):
    """The adapter class of ``kind``.

    Raises:
        PipelineError: ``kind`` is not a model kind (names the valid ones).
    """
    from pipeline.errors import PipelineError

    target = ADAPTERS.get(kind)
    if target is None:
        raise PipelineError(f"model.kind: {kind!r} is not a model kind; valid: {sorted(ADAPTERS)}")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def adapter(source: ModelSource) -> ModelAdapter:
    """The adapter for ``source.kind``, bound to ``source``.

    Raises:
        PipelineError: ``source.kind`` is not a model kind (see :func:`adapter_class`).
    """
    return adapter_class(source.kind)(source)

