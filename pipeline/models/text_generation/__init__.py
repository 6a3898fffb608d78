"""``model.kind: text-generation``: causal LMs with the KV cache as graph I/O.

* :mod:`.kv`: the KV-cache layout (names, geometry), the one home of it;
* :mod:`.model`: loading, the export wrapper, feeds, greedy decoding;
* :mod:`.adapter`: :class:`~.adapter.TextGenerationAdapter` (the kind's contract);
* :mod:`.metrics`: perplexity and greedy agreement;
* :mod:`.triton`: its Triton models and deploy notes;
* :mod:`.served`: the generation model that Triton's python backend runs (shipped into repositories).
"""
