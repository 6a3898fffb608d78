"""Triton python-backend models, each copied as ``model.py`` into a model's version folder
(:mod:`pipeline.triton.repository`). They import nothing of the pipeline; the pipeline imports
``onnxruntime_model``'s weight helpers to run graphs as the served model does
(:class:`pipeline.runners.weights_fed.WeightsFed`)."""
