"""``model.kind: sentence-embedding``: mean-pooled, normalised sentence encoders.

* :mod:`.model`: loading, the export wrapper, random feeds;
* :mod:`.adapter`: :class:`~.adapter.SentenceEmbeddingAdapter` (the kind's contract);
* :mod:`.metrics`: word-similarity Spearman, cosine to FP32, ORT's naive PTQ baseline.
"""
