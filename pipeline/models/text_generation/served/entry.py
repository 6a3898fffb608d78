"""Triton python-backend generation model: written as ``<repo>/<model>/<version>/model.py``, with
the ``served/`` folder beside it (:mod:`pipeline.models.text_generation.served`). The python backend
imports this file; it loads ``served/`` as a package of its own, fresh at every load (one name per
entry module, earlier copies dropped from ``sys.modules``), so two loads in one process never share
module state, and exposes that package's ``TritonPythonModel``."""
import importlib
import importlib.util
import os
import sys


def _load(folder, name):
    """The package in ``folder`` under the module name ``name``, executed anew; returns its ``model`` module."""
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(name + ".model")


TritonPythonModel = _load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "served"),
                          __name__.replace(".", "_") + "_served").TritonPythonModel
