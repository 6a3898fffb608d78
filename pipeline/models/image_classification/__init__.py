"""The ``image-classification`` model kind (:class:`.adapter.ImageClassificationAdapter`).

* :mod:`.graph`: the shipped ONNX classifier and its preparation (BN folding, named dims);
* :mod:`.preprocess`: image -> graph input (PaddleOCR text-direction normalisation);
* :mod:`.data`: labelled inputs from ``images`` / ``npz`` data sources;
* :mod:`.metrics`: top-1 accuracy, its drop (points) and FP32 agreement;
* :mod:`.serving` + ``preprocess_model.py``: the Triton preprocessing model and ensemble;
* :mod:`.render`: labelled text-line crops (0 / 180 degrees) rendered from real sentences.
"""
