"""Toolkit: checks on ONNX graphs.

* :mod:`.graph`: Q/DQ placement and graph rules TensorRT relies on.
* :mod:`.export`: the export's dynamic-shape proof and the faults of ``torch.onnx.export``.
* :mod:`.tolerance`: how close two runs of a graph must be, by precision.

May import: the base modules and the ground floor (recipe, sources).
"""
