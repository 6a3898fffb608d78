"""Imported by :mod:`crash`'s fork server: the package's import graph, which every build reads
once per process for its stage keys (:func:`pipeline.imports.closure`), so each fork starts with it."""
from pipeline import imports

imports.closure("pipeline.run.runner")
