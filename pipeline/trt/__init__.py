"""Toolkit: TensorRT and TensorRT-RTX engines.

* :mod:`.backends`: which builder (TensorRT, TensorRT-RTX, trtexec, none) builds for which target.
* :mod:`.builder`: parse an ONNX graph and build a serialized engine per optimization profile.
* :mod:`.profiles`: optimization profiles (min/opt/max) from the recipe.
* :mod:`.stamp`: the versions and GPU an engine was built for; :mod:`.report`: the build's report.
* :mod:`.trtexec`: the ``trtexec`` command line equivalent of a build.

May import: the base modules and the ground floor (recipe, sources).
"""
