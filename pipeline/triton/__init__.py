"""Triton Inference Server model repository: configs (:mod:`.config`), the
repository writer (:mod:`.repository`) and a local tritonserver launcher
(:mod:`.server`). Python-backend model templates live in ``templates/``:
``onnxruntime_model.py`` (target python-onnxruntime), ``generate_model.py``
(LLM generation, decoupled) and ``tokenizer_model.py`` (encoder text -> ids).
Serving and benchmarking a repository: :mod:`pipeline.serve`."""
