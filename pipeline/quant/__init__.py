"""Toolkit: quantization (our core).

* :mod:`.qdq`: explicit Q/DQ placement as TensorRT expects; :mod:`.calibrate`: amax calibration.
* :mod:`.smoothquant`: per-channel smoothing folded into the weights; :mod:`.autocast`: FP16/BF16 rest.
* :mod:`.sensitivity`, :mod:`.budget`, :mod:`.proxy`: the accuracy-budget search that picks what stays in
  high precision; :mod:`.pin`: the pinned result (``recipes/tuned/``).
* :mod:`.feeds`: calibration feeds saved and read back.

May import: the base modules and the ground floor (recipe, sources); never a model kind or a stage.
"""
