"""The ground floor: what a recipe reads.

* :mod:`.model`: where a model's weights come from (a shipped package, a folder, an ONNX file, a GGUF).
* :mod:`.data`: the data sources (corpus, text, jsonl, pairs, images, npz) for calibration and validation.

May import: the base modules and :mod:`pipeline.recipe`; nothing above the ground floor.
"""
