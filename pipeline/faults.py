"""Fault injection for crash and environment tests.

``PIPELINE_FAULT=<point>`` makes the process SIGKILL itself when it reaches that
point, as a power cut or the OOM killer would. With ``PIPELINE_FAULT_ERRNO=<name>``
(``ENOSPC``, ``EDQUOT``, ``EROFS``, ``EXDEV``, ... any :mod:`errno` name) the point
raises that ``OSError`` instead, as a full disk or a read-only mount would.
With ``PIPELINE_FAULT_SIGNAL=<name>`` (``SIGFPE``, ``SIGSEGV``, ``SIGABRT``, ...) the process
sends itself that signal instead of SIGKILL, as a native crash would; with
``PIPELINE_FAULT_IF=<text>`` a point fires only where the caller names something
holding that text (the engine builder's points name the parsed network's layers).
``PIPELINE_FAULT_DELAY_S=<seconds>`` makes every point whose name starts with
``$PIPELINE_FAULT_DELAY_AT`` (default: every point) sleep that long first, as a
slow network file system would at each write (for race tests).

Points: ``stage:<name>:start`` / ``stage:<name>:end`` (before a stage runs; after
it wrote its outputs, before its cache record); the publish steps
``publish:journal``, ``publish:model:<i>``, ``publish:stale``, ``publish:index``,
``publish:cleanup`` (see :mod:`pipeline.triton.publish`); and the write sites of
:mod:`pipeline.fsutil`: ``write:<file name>`` (every atomic write) and
``copy:<file name>`` (every copied model file); and, in the engine builder's child process
(:mod:`pipeline.trt.builder`), ``builder:parse`` and ``builder:build`` (before
``build_serialized_network``).
"""
from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Iterable

ENV = "PIPELINE_FAULT"
ERRNO_ENV = "PIPELINE_FAULT_ERRNO"
DELAY_ENV = "PIPELINE_FAULT_DELAY_S"
DELAY_AT_ENV = "PIPELINE_FAULT_DELAY_AT"
SIGNAL_ENV = "PIPELINE_FAULT_SIGNAL"
IF_ENV = "PIPELINE_FAULT_IF"


def fault_point(name: str, path: str | os.PathLike | None = None, present: Iterable[str] = ()) -> None:
    """Sleep ``$PIPELINE_FAULT_DELAY_S`` seconds when set (and ``name`` starts with
    ``$PIPELINE_FAULT_DELAY_AT``); then, when ``$PIPELINE_FAULT``
    equals ``name``, raise ``OSError($PIPELINE_FAULT_ERRNO)`` naming ``path`` if that is
    set, else send this process ``$PIPELINE_FAULT_SIGNAL`` (default SIGKILL). With
    ``$PIPELINE_FAULT_IF`` set, only when an item of ``present`` holds that text. Nothing otherwise.

    Raises:
        OSError: the injected errno (its ``filename`` is ``path``).
        ValueError: ``$PIPELINE_FAULT_ERRNO`` is not an errno name, or ``$PIPELINE_FAULT_SIGNAL``
            not a signal name.
    """
    delay = os.environ.get(DELAY_ENV)
    if delay and name.startswith(os.environ.get(DELAY_AT_ENV, "")):
        time.sleep(float(delay))
    if os.environ.get(ENV) != name:
        return
    wanted = os.environ.get(IF_ENV)
    if wanted and not any(wanted in item for item in present):
        return
    code = os.environ.get(ERRNO_ENV)
    if code:
        if not hasattr(errno, code):
            raise ValueError(f"{ERRNO_ENV}={code!r} is not an errno name (e.g. ENOSPC, EROFS)")
        num = getattr(errno, code)
        raise OSError(num, os.strerror(num), None if path is None else os.fspath(path))
    sig = os.environ.get(SIGNAL_ENV) or "SIGKILL"
    if not isinstance(getattr(signal, sig, None), signal.Signals):
        raise ValueError(f"{SIGNAL_ENV}={sig!r} is not a signal name (e.g. SIGFPE, SIGSEGV)")
    os.kill(os.getpid(), getattr(signal, sig))
