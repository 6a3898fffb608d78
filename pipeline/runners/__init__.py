"""Toolkit: running a graph and reading its outputs.

* :mod:`.base`: the runner protocol and ONNX Runtime / TensorRT runners.
* :mod:`.weights_fed`: an ONNX Runtime session whose weights are fed as inputs (the served template's way).

May import: the base modules, the ground floor and :mod:`pipeline.triton.templates` (the code shipped into
model repositories).
"""
