"""Reading a recipe: YAML with line numbers (a key given twice is refused), the CLI's
``--set`` overrides, validation against the schema (:mod:`pipeline.recipe.schema`) and the
cross-section checks (:mod:`pipeline.recipe.checks`), and errors that name
``file:line``, the key path and what is valid.
"""
from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.errors import RecipeError
from pipeline.sources.model import SOURCE_KEYS
from pipeline.recipe.schema import Recipe
from pipeline.recipe.legacy import OLD_GATE_FIELDS
from pipeline.recipe.checks import constraint_problems
from pipeline.recipe.problems import ConstraintErrors, Problem, dotted


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        _refuse_duplicates(self, node, (), recurse=False)
        return super().construct_mapping(node, deep=deep)


def _key_value(loader: yaml.SafeLoader, key_node: yaml.Node) -> object:
    """The key as the mapping will hold it (``0`` and ``00`` are both int 0)."""
    try:
        value = loader.construct_object(key_node, deep=True)
        hash(value)
        return value
    except (yaml.YAMLError, TypeError):
        return (key_node.tag, str(key_node.value))


def _refuse_duplicates(loader: yaml.SafeLoader, node: yaml.Node, path: tuple, recurse: bool = True) -> None:
    """Raise RecipeError for every key listed more than once in one mapping (anywhere under
    ``node`` when ``recurse``), all of them in one message; ``path`` is the key path of ``node``."""
    found = [text for _, text in sorted(_duplicates(loader, node, path, recurse))]
    if len(found) == 1:
        raise RecipeError(f"{found[0]}; keep one (YAML would silently keep the last)")
    if found:
        raise RecipeError(f"{len(found)} keys are given more than once; keep one of each (YAML would silently "
                          "keep the last):\n  " + "\n  ".join(found))


def _duplicates(loader: yaml.SafeLoader, node: yaml.Node, path: tuple, recurse: bool) -> list[tuple[int, str]]:
    """(first line, message) of each key listed more than once in one mapping under ``node``: its key
    path and every line it is on."""
    out: list[tuple[int, str]] = []
    if isinstance(node, yaml.SequenceNode) and recurse:
        for i, item in enumerate(node.value):
            out += _duplicates(loader, item, (*path, i), recurse)
    if not isinstance(node, yaml.MappingNode):
        return out
    seen: dict[object, list[int]] = {}
    shown: dict[object, str] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = _key_value(loader, key_node)
        seen.setdefault(key, []).append(key_node.start_mark.line + 1)
        shown.setdefault(key, ".".join(str(p) for p in (*path, key_node.value)))
        if recurse:
            out += _duplicates(loader, value_node, (*path, key_node.value), recurse)
    for key, lines in seen.items():
        if len(lines) == 2:
            out.append((lines[0], f"key {shown[key]!r} is given twice, at lines {lines[0]} and {lines[1]}"))
        elif len(lines) > 2:
            out.append((lines[0], f"key {shown[key]!r} is given {len(lines)} times, at lines "
                                  f"{', '.join(map(str, lines[:-1]))} and {lines[-1]}"))
    return out


def parse_yaml(text: str, source: str) -> tuple[object, yaml.Node | None]:
    """Parse one YAML document; returns (data, node tree for line lookups).

    Raises:
        RecipeError: not YAML, or keys given more than once in one mapping (every one, naming
            its key path and lines); the message starts with ``source``.
    """
    try:
        loader = _RecipeLoader(text)  # the reader refuses control characters here
    except yaml.reader.ReaderError as e:
        e.name = source  # PyYAML names a string "<unicode string>"
        raise RecipeError(f"{source}: not valid YAML: {e}") from None
    loader.name = source  # the marks of every later error name the file
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _refuse_alias_blowup(node)
        _refuse_duplicates(loader, node, ())
        return loader.construct_document(node), node
    except yaml.YAMLError as e:
        raise RecipeError(f"{source}: not valid YAML: {e}") from None
    except (ValueError, TypeError) as e:  # an explicit tag the value does not fit: !!int x
        raise RecipeError(f"{source}: not valid YAML: {e}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise RecipeError(f"{source}: nested deeper than a recipe can be ({MAX_DEPTH} levels at most)") from None
    except RecipeError as e:
        raise RecipeError(f"{source}: {e}") from None
    finally:
        loader.dispose()


#: nodes a recipe may expand to through YAML aliases (``*x``); the shipped recipes have < 1000
MAX_NODES = 100_000
#: nesting a recipe may have (the schema's deepest path is 6 levels)
MAX_DEPTH = 64


def _refuse_alias_blowup(root: yaml.Node) -> None:
    """Refuse an alias that contains itself (``a: &x [*x]``) or aliases that expand past
    :data:`MAX_NODES` (a "billion laughs" document), before anything is built from them.

    Raises:
        RecipeError: names the line of the offending alias or the count.
    """
    count, on_path = 0, set()

    def visit(node: yaml.Node) -> None:
        nonlocal count
        count += 1
        if len(on_path) > MAX_DEPTH:
            raise RecipeError(f"line {node.start_mark.line + 1}: nested deeper than a recipe can be "
                              f"({MAX_DEPTH} levels at most)")
        if count > MAX_NODES:
            raise RecipeError(f"its aliases expand to more than {MAX_NODES:,} values (line "
                              f"{node.start_mark.line + 1}); valid: a recipe without nested alias fan-out")
        if id(node) in on_path:
            raise RecipeError(f"line {node.start_mark.line + 1}: an alias refers to a value that contains it; "
                              "valid: aliases of finished values only")
        children = node.value if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)) else []
        on_path.add(id(node))
        for child in children:
            for sub in (child if isinstance(child, tuple) else (child,)):
                visit(sub)
        on_path.discard(id(node))

    visit(root)


def yaml_line(node: yaml.Node | None, loc: Sequence[str | int]) -> int | None:
    """1-based line of the key at ``loc`` in the node tree (of its deepest existing
    parent when the key itself is absent); None without a tree."""
    return _walk(node, loc)[0]


def _walk(node: yaml.Node | None, loc: Sequence[str | int]) -> tuple[int | None, yaml.Node | None]:
    """(:func:`yaml_line`, the value node at ``loc`` or None when a key on the way is absent)."""
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if str(k.value) == str(part)), None)
            if match is None:
                return line, None
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line, None
    return line, node


def _quote_hint(got, node: yaml.Node | None, loc: tuple, setter: str | None = None) -> str:
    """For a number where a string is wanted: YAML read an unquoted scalar as a number
    (``24.10`` is the float 24.1), so say to quote it, with the text as written. ``setter``: the
    ``--set`` key that gave the value (the file's text at ``loc`` is not what was read then)."""
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return ""
    if setter is not None:
        key = dotted(loc)
        if isinstance(got, int):  # the text typed was the number's digits
            read, typed = f"an unquoted {got} as a number", str(got)
        else:  # 24.10 and 24.1 read alike: the text typed is gone
            read, typed = "an unquoted value as a number (24.10 as 24.1)", "<as typed>"
        example = f", e.g. --set \"{key}='{typed}'\"" if setter == key else ""
        return f"; --set reads its value as YAML, which reads {read}: quote it inside the argument{example}"
    value = _walk(node, loc)[1]
    if not isinstance(value, yaml.ScalarNode):  # e.g. a YAML alias: the text as written is elsewhere
        return "; YAML reads an unquoted value as a number (24.10 as 24.1): quote it as written, e.g. '24.10'"
    shown = f"the number {got!r}" if value.value != str(got) else "a number"
    return f"; YAML reads the unquoted {value.value} as {shown}: quote it, e.g. '{value.value}'"


#: Union fields whose error locations carry the chosen member's tag (``model.source.entry.entry``).
_UNION_TAGS = {"source": set(SOURCE_KEYS),
               "data": {"corpus", "text", "jsonl", "pairs", "images", "npz"}}


def _untagged(loc: tuple) -> tuple:
    """``loc`` without the tag pydantic inserts after a discriminated union field."""
    return tuple(part for i, part in enumerate(loc)
                 if not (i and isinstance(loc[i - 1], str) and part in _UNION_TAGS.get(loc[i - 1], ())
                         and i + 1 < len(loc)))


def _field(model: type[BaseModel], key: str):
    """The field of ``model`` that the recipe key ``key`` sets: by its alias (``validate`` is
    the field ``validate_``) or, without one, by its name; None when there is none."""
    return next((f for name, f in model.model_fields.items() if (f.alias or name) == key), None)


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that holds the key at ``loc`` (a validation error's location), or None
    where the path goes through something other than plain nested models and lists."""
    model: type[BaseModel] = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # a list item: its model is the list's item type, resolved below
        field = _field(model, part)
        if field is None:
            return None
        target = field.annotation
        while typing.get_origin(target) is not None:  # Optional[...] / list[...] / Annotated[...]
            args = [a for a in typing.get_args(target) if a is not type(None)]
            if len(args) != 1:
                return None
            target = args[0]
        if not (isinstance(target, type) and issubclass(target, BaseModel)):
            return None
        model = target
    return model


def _unknown_key_message(loc: tuple) -> str:
    """``unknown key`` with the closest valid key and the valid keys, where they can be found."""
    model = _model_at(loc)
    if model is None or not isinstance(loc[-1], str):
        return "unknown key; remove it or check its spelling"
    valid = sorted(f.alias or name for name, f in model.model_fields.items())
    close = difflib.get_close_matches(loc[-1], valid, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown key; {hint}valid keys here: {', '.join(valid)}"


def _validation_problems(err: ValidationError, node: yaml.Node | None = None,
                         overrides: Sequence[str] = ()) -> list[Problem]:
    """The ``(key path, message)`` of each schema error in ``err``; a validator's
    :class:`ConstraintErrors` give their own problems. ``node``: the recipe's YAML tree,
    for the text of a value YAML read as a number where a string is wanted; ``overrides``: the
    ``--set`` keys (a value one of them gave is not the file's)."""
    items: list[Problem] = []
    for e in err.errors():
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, ConstraintErrors):
            items += cause.problems
            continue
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = _unknown_key_message(tuple(e["loc"]))
        got = e.get("input")
        shown = "" if e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) else f" (got {got!r})"
        loc = _untagged(tuple(e["loc"]))
        hint = _quote_hint(got, node, loc, _setter(dotted(loc), overrides)) if e["type"] == "string_type" else ""
        items.append((loc, msg + shown + hint))
    return items


def _setter(key: str, overrides: Sequence[str]) -> str | None:
    """The ``--set`` key (of ``overrides``) that set the recipe key ``key``, or one inside it; None: the file's."""
    setters = [o for o in overrides if key == o or key.startswith(o + ".") or o.startswith(key + ".")]
    return setters[-1] if setters else None


def _format_problems(path: Path, items: list[Problem], node: yaml.Node | None, overrides: Sequence[str]) -> str:
    """One line per failing key: ``file:line: key.path: what is wrong (got ...)``."""
    lines = [f"{path}: invalid recipe ({len(items)} error(s))"]
    for loc, msg in items:
        key = dotted(loc)
        setter = _setter(key, overrides)
        line = yaml_line(node, loc)
        if setter is not None:
            lines.append(f"  {key}: {msg} [from --set {setter}]")
        elif line is not None:
            lines.append(f"  {path}:{line}: {key}: {msg}")
        else:
            lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def load_recipe(path: str | Path, overrides: dict | None = None) -> Recipe:
    """Read and validate a YAML recipe. Its data sources are bound to the recipe's
    folder: relative data paths are read from there.

    Args:
        path: the recipe file.
        overrides: dotted key path (list indices allowed, ``build.profiles.0.dims.batch.max``)
            -> value, applied before validation (the CLI's ``--set``).

    Raises:
        RecipeError: the file is missing, is not YAML, gives a key twice in one
            mapping, an override path does not fit the recipe, or the recipe breaks
            the schema or a constraint between sections (:mod:`pipeline.recipe.checks`);
            the message names the file, each failing key path with its YAML line (or
            the ``--set`` that set it) and what is valid.
    """
    path = Path(path)
    if not path.is_file():
        near = sorted(p.name for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        raise RecipeError(f"{path}: recipe file not found" + (f"; recipes in {path.parent}/: {', '.join(near)}"
                                                              if near else ""))
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot read the recipe: {e}") from None
    data, node = parse_yaml(text, str(path))
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: top level must be a mapping of sections")
    for dotted_key, value in (overrides or {}).items():
        _refuse_old_set(dotted_key)
        set_dotted(data, dotted_key, value)
    try:
        recipe = Recipe.model_validate(data, context={"base_dir": path.parent})
    except ValidationError as e:
        sets = list(overrides or {})
        raise RecipeError(_format_problems(path, _validation_problems(e, node, sets), node, sets)) from None
    problems = constraint_problems(recipe)
    if problems:
        raise RecipeError(_format_problems(path, problems, node, list(overrides or {})))
    return recipe


def _refuse_old_set(dotted_key: str) -> None:
    """A ``--set`` of a field of the older recipe shape fails with the key to set now.

    Raises:
        RecipeError: the key is a flat gate field, ``dataset``/``split`` of calibration
            or validate, or ``validate.metric``.
    """
    parts = dotted_key.split(".")
    if parts[:2] == ["validate", "gates"] and len(parts) == 3 and parts[2] in OLD_GATE_FIELDS:
        metric, bound = OLD_GATE_FIELDS[parts[2]]
        raise RecipeError(f"--set {dotted_key}: validate.gates is now a list; set the bound of the gate on "
                          f"{metric} by index (--set validate.gates.<i>.{bound}=<x>) or give the whole list "
                          f"(--set 'validate.gates=[{{metric: {metric}, {bound}: <x>}}]')")
    for section in (["validate"], ["quantize", "calibration"]):
        n = len(section)
        if parts[:n] == section and len(parts) > n and parts[n] in ("dataset", "split"):
            rest = ".".join(["split", *parts[n + 1:]] if parts[n] == "split" else ["name"])
            raise RecipeError(f"--set {dotted_key}: {parts[n]} moved into the data source; "
                              f"set {'.'.join(section)}.data.{rest}")
    if parts == ["validate", "metric"]:
        raise RecipeError("--set validate.metric: removed (it was never read); drop this --set")


def set_dotted(data: dict, dotted_key: str, value: object) -> None:
    """Set ``data[k1][k2]...`` = ``value`` for ``dotted_key`` "k1.k2...": a part that
    indexes a list must be an index in range; missing mapping keys are created.

    Raises:
        RecipeError: an empty part, an index that is not an int or out of range, or a
            path through a scalar; the message names ``--set KEY``.
    """
    parts = dotted_key.split(".")
    if not all(parts):
        raise RecipeError(f"--set {dotted_key}: empty key part; write a dotted path like validate.gates.0.max")
    node: object = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        here = ".".join(parts[:depth]) or "the recipe"
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"--set {dotted_key}: {here} is a list of {len(node)} item(s); "
                                  f"{part!r} is not an index in 0..{len(node) - 1}; to add or remove items, "
                                  f"set the whole list: --set '{here}=[...]'")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise RecipeError(f"--set {dotted_key}: {here} is {node!r}, not a section or list, so it has no {part!r}")


def parse_set_value(text: str) -> object:
    """A ``--set`` VALUE: YAML when it parses, else a bracketed list of plain strings
    (``[*mlp*, "x"]``), else the plain string."""
    try:
        return parse_yaml(text, "value")[0]
    except RecipeError:
        pass
    inner = text.strip()
    if inner.startswith("[") and inner.endswith("]"):
        items = [item.strip() for item in inner[1:-1].split(",")]
        return [item[1:-1] if len(item) > 1 and item[0] == item[-1] and item[0] in "\"'" else item
                for item in items if item]
    return text


def parse_set(items: list[str]) -> dict[str, object]:
    """``["a.b=1", ...]`` -> ``{"a.b": 1, ...}`` (see :func:`parse_set_value`).

    Raises:
        RecipeError: an item without ``=`` or with an empty key.
    """
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. validate.gates.0.max=0.01")
        out[key.strip()] = parse_set_value(value)
    return out


def load_from_args(args):
    """The recipe of ``args`` with its ``--set`` overrides; kept on ``args`` so an
    internal error can save its traceback next to the recipe's artifacts.

    Raises:
        RecipeError: see :func:`load_recipe`.
    """
    args.loaded_recipe = load_recipe(args.recipe, parse_set(args.set))
    return args.loaded_recipe
