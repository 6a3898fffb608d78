"""The ``generic`` model kind: any torch module (``entry:``) or ONNX graph (``onnx:``),
measured by agreement with its FP32 outputs (:mod:`.adapter`, :mod:`.metrics`, :mod:`.feeds`)."""
from pipeline.models.generic.adapter import GenericAdapter

__all__ = ["GenericAdapter"]
