"""Triton Inference Server model repository: configs (:mod:`.config`), the
repository writer (:mod:`.repository`) and a local tritonserver launcher
(:mod:`.server`). Python-backend model templates live in ``templates/``."""
