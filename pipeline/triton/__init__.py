"""Triton Inference Server model repository: configs (:mod:`.config`), the
repository writer (:mod:`.repository`) and a local tritonserver launcher
(:mod:`.server`). Python-backend model templates live in ``templates/``:
``onnxruntime_model.py`` (target python-onnxruntime) and ``tokenizer_model.py``
(encoder text -> ids); the LLM generation model (decoupled) is the text-generation kind's
(:mod:`pipeline.models.text_generation.served`).
Serving and benchmarking a repository: :mod:`pipeline.serve`."""
