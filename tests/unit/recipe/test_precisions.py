"""The precision table is the one home of what a precision is."""
from __future__ import annotations

import ast
import typing
from pathlib import Path

from pipeline.checks import tolerance
from pipeline.recipe import precisions
from pipeline.recipe.schema import Precision, QuantizeConfig

PACKAGE = Path(precisions.__file__).resolve().parents[1]
#: the table itself, the quantizer's numerics (quant/), and code shipped into model repositories
EXEMPT = ("recipe/precisions.py", "quant/", "triton/templates/")


def test_the_schema_takes_its_precisions_from_the_table():
    assert typing.get_args(Precision) == precisions.QUANTIZE
    rest = QuantizeConfig.model_fields["rest_precision"]
    assert typing.get_args(rest.annotation) == precisions.REST and rest.default == precisions.REFERENCE
    assert precisions.REST[0] == precisions.REFERENCE  # the default is listed first


def test_every_precision_has_an_export_tolerance():
    for name, row in precisions.PRECISIONS.items():
        assert tolerance.tolerance(name) == row.export_tolerance


def test_capability_problem_names_the_precision_and_the_gpu():
    assert precisions.capability_problem("fp8", (8, 9), "sm89") is None
    assert precisions.capability_problem("int8", (7, 5), "sm75") is None
    assert precisions.capability_problem("bf16", (7, 5), "sm75") == \
        "BF16 needs compute capability >= 8.0; sm75 has compute capability 7.5"


def _literal_comparisons(path: Path) -> list[str]:
    names = set(precisions.PRECISIONS)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        consts = [c for s in sides for c in ([s] if not isinstance(s, (ast.Tuple, ast.List, ast.Set)) else s.elts)]
        if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_no_module_compares_precision_names_outside_the_table_and_the_quantizer():
    """Adding a precision touches the table and the quantizer's numerics, nothing else."""
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             if not str(path.relative_to(PACKAGE)).startswith(EXEMPT)
             for hit in _literal_comparisons(path)]
    assert found == []
