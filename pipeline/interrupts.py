"""Ctrl-C and SIGTERM: one handler, installed by the CLI only (:func:`handled`).

Both signals raise ``KeyboardInterrupt`` in the main thread, which the CLI turns
into exit 130. They are installed explicitly: a SIGINT disposition inherited as
"ignored" (some launchers and test runners pass that on) would otherwise make
Ctrl-C a no-op. Each signal is also recorded, because Python swallows an
exception raised while it runs a GC or weakref callback; long loops call
:func:`check` at safe points (the runner, between stages) to re-raise it.
Library code (the runner, serve, bench) installs no handler.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_signalled: list[int] = []


def _raise_keyboard_interrupt(signum, frame):
    _signalled.append(signum)
    raise KeyboardInterrupt(f"signal {signum}")


def check() -> None:
    """Raise KeyboardInterrupt when a signal arrived whose exception may have been swallowed."""
    if _signalled:
        raise KeyboardInterrupt(f"signal {_signalled[-1]}")


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (main thread only:
    elsewhere Python cannot install handlers, and the block runs unchanged); the
    previous handlers come back on exit."""
    _signalled.clear()
    main = threading.current_thread() is threading.main_thread()
    sigs = (signal.SIGINT, signal.SIGTERM) if main else ()
    old = {sig: signal.signal(sig, _raise_keyboard_interrupt) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        _signalled.clear()
