"""docs/reference/recipe.md is generated from the schema, current, and complete."""
from __future__ import annotations

import pytest

from pipeline import docs_reference
from pipeline.recipe.schema import Gate, QuantizeConfig, Recipe


def test_committed_reference_is_current():
    committed = docs_reference.REFERENCE.read_text(encoding="utf-8")
    assert committed == docs_reference.render(), "docs/reference/recipe.md is stale: run make docs"


def test_check_flag_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "recipe.md"
    stale.write_text("# old\n")
    monkeypatch.setattr(docs_reference, "REFERENCE", stale)
    assert docs_reference.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert docs_reference.main([]) == 0
    assert docs_reference.main(["--check"]) == 0


FIELDS = [(m.__name__, key, f) for m in docs_reference.models()
          for key, f in ((f.alias or n, f) for n, f in m.model_fields.items())]


@pytest.mark.parametrize("model,key,field", FIELDS, ids=[f"{m}.{k}" for m, k, _ in FIELDS])
def test_every_recipe_field_has_a_description(model, key, field):
    assert field.description and field.description.strip(), f"{model}.{key} needs a description"


def test_walk_reaches_nested_sections_and_union_members():
    found = docs_reference.models()
    names = {m.__name__ for m in found}
    assert {"TuningConfig", "Gate", "CorpusSource", "NpzSource", "PackageSource", "OnnxSource", "Range",
            "DimRange", "ServeSLO"} <= names
    assert found[Gate] == ["quantize.accuracy_budget", "validate.gates[]"]
    assert found[Recipe] == [""]
    assert len(FIELDS) > 100


def test_rows_give_type_default_and_description():
    text = docs_reference.section(QuantizeConfig, ["quantize"])
    assert '| `precision` | "fp8" \\| "int8" \\| "fp16" \\| "fp32" \\| "int4" \\| "nvfp4" | *required* |' in text
    assert '| `quantize_op_types` | list["MatMul" \\| "Gemm" \\| "Conv"] | `["MatMul", "Gemm"]` |' in text
    assert "| `accuracy_budget` | [Gate](#gate) \\| null | `null` |" in text
    assert "| `exclude` | [ExcludeConfig](#excludeconfig) | defaults |" in text
    assert "`validate`" in docs_reference.section(Recipe, [""])  # the YAML key, not the attribute validate_
