"""The ground floor: what one run asks for.

* :mod:`.schema`: the recipe's pydantic models (strict: unknown keys are errors).
* :mod:`.load`: reading a recipe file with ``--set`` overrides; :mod:`.legacy` renames retired keys.
* :mod:`.problems`: the problem types a recipe check reports; :mod:`.checks`: cross-field rules.
* :mod:`.kinds`: one row of facts per model kind; :mod:`.gates`: which gate metrics each kind offers.
* :mod:`.precisions`: one row per numeric precision.

May import: the base modules at the package root (errors, fsutil, artifacts, onnx_io, provenance)
and :mod:`pipeline.targets`; nothing above the ground floor.
"""
