"""What is wrong with a recipe, as data: a key path (``Loc``) and a message per problem.

The schema's validators (:mod:`pipeline.recipe.schema`) and the cross-section checks
(:mod:`pipeline.recipe.checks`) both report :class:`ConstraintErrors`; the loader
(:mod:`pipeline.recipe.load`) prints each problem with the YAML line of its key.
"""
from __future__ import annotations

#: Key path from the recipe root, e.g. ``("build", "profiles", 0, "name")``.
Loc = tuple[str | int, ...]
#: ``(key path, message)``.
Problem = tuple[Loc, str]


class ConstraintErrors(ValueError):
    """Cross-section constraint violations of one recipe; ``problems`` holds (loc, message)."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(f"{dotted(loc)}: {msg}" for loc, msg in problems))


def dotted(loc: Loc) -> str:
    """``("build", "profiles", 0, "name")`` -> ``"build.profiles.0.name"``."""
    return ".".join(str(p) for p in loc) or "<root>"
