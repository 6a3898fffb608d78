"""The recipe reference, ``docs/reference/recipe.md``, generated from the pydantic schema.

Every model reached from :class:`pipeline.recipe.schema.Recipe` (nested sections, list items,
the members of the model-source and data-source unions) gets one table: each field's
YAML key, type, default and ``description``. ``python -m pipeline.docs_reference``
(``make docs``) rewrites the file; ``--check`` exits 1 when the committed file differs.
"""
from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from pipeline.recipe.schema import Recipe

#: The generated file, relative to the repository root.
REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "recipe.md"

HEADER = """# Recipe reference

Generated from the pydantic schema (`pipeline/recipe/schema.py`, `pipeline/sources/data/schema.py`,
`pipeline/sources/model.py`) by `make docs` (`python -m pipeline.docs_reference`); do not
edit by hand: `tests/docs/test_docs_reference.py` fails when this file is stale. The guide to
writing a recipe is [docs/recipes-and-gates.md](../recipes-and-gates.md).

Every section forbids unknown keys. *required* marks a field without a default.
"""


def models(root: type[BaseModel] = Recipe) -> dict[type[BaseModel], list[str]]:
    """Every model reachable from ``root`` through its field annotations -> the recipe
    key paths where it appears (``[]`` marks a list item), in depth-first order."""
    found: dict[type[BaseModel], list[str]] = {}

    def walk(model: type[BaseModel], path: str) -> None:
        paths = found.setdefault(model, [])
        if path not in paths:
            paths.append(path)
        for key, annotation in field_types(model).items():
            for child, suffix in _nested(annotation):
                walk(child, f"{path}.{key}{suffix}".lstrip("."))

    walk(root, "")
    return found


def field_types(model: type[BaseModel]) -> dict[str, object]:
    """YAML key -> resolved annotation of each field (forward references such as
    ``"Gate | None"`` resolved in the model's module, without rebuilding the model)."""
    hints = typing.get_type_hints(model, include_extras=True)
    return {field.alias or name: hints.get(name, field.annotation) for name, field in model.model_fields.items()}


def _nested(annotation: object, suffix: str = "") -> list[tuple[type[BaseModel], str]]:
    """The models inside a type (through unions, ``Annotated``, lists and dict values)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, suffix)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _nested(args[0], suffix)
    if origin is list:
        return _nested(args[0], suffix + "[]")
    if origin is dict:
        return _nested(args[1], suffix + ".<key>")
    return [m for a in args for m in _nested(a, suffix)]


def type_name(annotation: object) -> str:
    """A type as a reader of YAML sees it: ``int``, ``"a" | "b"``, ``list[Gate]``, ``Gate | null``."""
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})" if issubclass(annotation, BaseModel) \
            else annotation.__name__
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]"
    return str(annotation)


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it (JSON flow style), or *required*."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "*required*"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "defaults"
    return f"`{json.dumps(to_jsonable_python(value))}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section(model: type[BaseModel], paths: list[str]) -> str:
    """One model's Markdown section: heading, where it appears, docstring's first paragraph, field table."""
    lines = [f"## {model.__name__}", ""]
    where = ", ".join(f"`{p}`" for p in paths if p) or "the recipe file itself"
    lines += [f"At: {where}.", ""]
    doc = (model.__doc__ or "").strip().split("\n\n")[0]
    if doc and model.__module__.startswith("pipeline"):
        lines += [" ".join(doc.split()), ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    annotations = field_types(model)
    for name, field in model.model_fields.items():
        key = field.alias or name
        lines.append(f"| `{key}` | {type_name(annotations[key])} | {default_text(field)} "
                     f"| {_cell(field.description or '')} |")
    return "\n".join(lines) + "\n"


def render() -> str:
    """The whole reference page."""
    return HEADER + "\n" + "\n".join(section(m, p) for m, p in models().items())


def main(argv: list[str] | None = None) -> int:
    """Write :data:`REFERENCE` (or, with ``--check``, report whether it is current: exit 1 if not)."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.docs_reference", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = REFERENCE.read_text(encoding="utf-8") if REFERENCE.exists() else ""
        if current != text:
            print(f"{REFERENCE} is stale: run make docs", file=sys.stderr)
            return 1
        print(f"{REFERENCE}: current")
        return 0
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
