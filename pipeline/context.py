"""What a stage receives besides its upstream artifacts."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, TypeVar

from rich.console import Console
from rich.progress import track

from pipeline.recipe.schema import Recipe

T = TypeVar("T")


class Progress:
    """Progress lines and bars on stderr (rich); quiet=True prints nothing. Long lines are
    not broken (soft wrap): a CI log keeps paths whole, a terminal wraps them itself."""

    def __init__(self, quiet: bool = False):
        self.console = Console(stderr=True, quiet=quiet, soft_wrap=True)
        self.quiet = quiet

    @contextlib.contextmanager
    def step(self, text: str) -> Iterator[None]:
        start = time.perf_counter()
        with self.console.status(text):
            yield
        self.done(text, time.perf_counter() - start)

    def track(self, items: Iterable[T], text: str, total: int | None = None) -> Iterator[T]:
        """Yield ``items``; a transient bar on a terminal, none in a log; then the
        ``step`` line with the seconds the loop took."""
        if self.quiet:
            yield from items
            return
        start = time.perf_counter()
        if self.console.is_terminal:
            items = track(items, description=f"  {text}", total=total, console=self.console, transient=True)
        yield from items
        self.done(text, time.perf_counter() - start)

    def done(self, text: str, seconds: float) -> None:
        """The indented line under a stage's name: what was done and its wall time (s)."""
        self.console.print(f"  {text} [dim]({seconds:.1f} s)[/dim]", highlight=False)

    def print(self, text: str) -> None:
        self.console.print(text)


@dataclass
class RunStart:
    """What a stage's ``before_run`` hook sees: the run before its first stage.

    A stage module may declare ``before_run(start: RunStart) -> dict``; the runner calls the hooks of the
    stages a run walks, in stage order, before the first stage, and hands every :class:`StageContext`
    the fields they return (e.g. ``{"pin": ...}``). A hook raises to stop the run before any stage.
    """
    recipe: Recipe
    recipe_path: Path
    progress: Progress
    inputs: dict  # pipeline.provenance.inputs(): input name -> {"path", "sha256"}, hashed once per run
    manifest: dict  # the run's manifest, which a hook may add a section to
    locked: bool = False  # build --locked
    pin_ignore: str = ""  # non-empty: why no tuning pin applies to this run (tune, build --test)


@dataclass
class StageContext:
    recipe: Recipe
    recipe_path: Path
    run_dir: Path  # <work_dir>/<recipe name>
    stage: str = ""
    progress: Progress = field(default_factory=Progress)
    pin: Any = None  # pipeline.quant.pin.PinLookup: the quantize stage's pinned tuning result, if any
    bisect_crash_s: float | None = None  # build --bisect-crash: reduce a builder crash's graph within this time

    @property
    def stage_dir(self) -> Path:
        path = self.run_dir / self.stage
        path.mkdir(parents=True, exist_ok=True)
        return path
