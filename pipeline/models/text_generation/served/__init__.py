"""The served generation model: Triton's python backend runs it, decoupled (prompt -> streamed tokens,
batched in flight). It ships as one model version folder: :mod:`.entry` becomes ``<version>/model.py``
and the other modules of this folder go into ``<version>/served/``
(:func:`pipeline.models.text_generation.triton.write_served`).

* :mod:`.entry`: what the backend imports; loads this folder as a package and exposes ``TritonPythonModel``;
* :mod:`.model`: ``TritonPythonModel`` (its config parameters, ``initialize``, ``execute``, ``finalize``, statistics);
* :mod:`.protocol`: a request's inputs read and checked, a response's outputs;
* :mod:`.scheduler`: admission, the steps, sampling and streaming, finishing, cancelling and errors;
* :mod:`.kv`: the KV cache: budget, per-sequence allocation, padded feeds and the compute step;
* :mod:`.sequence`: one request's generation state;
* :mod:`.decoding`: incremental detokenization, stop strings and next-token sampling;
* :mod:`.chat`: chat templates rendered as transformers does;
* :mod:`.scoring`: log-softmax and top log-probabilities;
* :mod:`.compute`: the compute graph, in this process (ONNX Runtime) or through BLS.

May import: nothing of the pipeline (it runs inside tritonserver's python stub); its modules import
each other relatively, and numpy, tokenizers, jinja2, onnx, onnxruntime and
``triton_python_backend_utils``.
"""
