"""Fault injection for crash and environment tests.

``PIPELINE_FAULT=<point>`` makes the process SIGKILL itself when it reaches that
point, as a power cut or the OOM killer would. With ``PIPELINE_FAULT_ERRNO=<name>``
(``ENOSPC``, ``EDQUOT``, ``EROFS``, ``EXDEV``, ... any :mod:`errno` name) the point
raises that ``OSError`` instead, as a full disk or a read-only mount would.
``PIPELINE_FAULT_DELAY_S=<seconds>`` makes every point whose name starts with
``$PIPELINE_FAULT_DELAY_AT`` (default: every point) sleep that long first, as a
slow network file system would at each write (for race tests).

Points: ``stage:<name>:start`` / ``stage:<name>:end`` (before a stage runs; after
it wrote its outputs, before its cache record); the publish steps
``publish:journal``, ``publish:model:<i>``, ``publish:stale``, ``publish:index``,
``publish:cleanup`` (see :mod:`pipeline.triton.publish`); and the write sites of
:mod:`pipeline.fsutil`: ``write:<file name>`` (every atomic write) and
``copy:<file name>`` (every copied model file).
"""
from __future__ import annotations

import errno
import os
import signal
import time

ENV = "PIPELINE_FAULT"
ERRNO_ENV = "PIPELINE_FAULT_ERRNO"
DELAY_ENV = "PIPELINE_FAULT_DELAY_S"
DELAY_AT_ENV = "PIPELINE_FAULT_DELAY_AT"


def fault_point(name: str, path: str | os.PathLike | None = None) -> None:
    """Sleep ``$PIPELINE_FAULT_DELAY_S`` seconds when set (and ``name`` starts with
    ``$PIPELINE_FAULT_DELAY_AT``); then, when ``$PIPELINE_FAULT``
    equals ``name``, raise ``OSError($PIPELINE_FAULT_ERRNO)`` naming ``path`` if that is
    set, else SIGKILL this process. Nothing otherwise.

    Raises:
        OSError: the injected errno (its ``filename`` is ``path``).
        ValueError: ``$PIPELINE_FAULT_ERRNO`` is not an errno name.
    """
    delay = os.environ.get(DELAY_ENV)
    if delay and name.startswith(os.environ.get(DELAY_AT_ENV, "")):
        time.sleep(float(delay))
    if os.environ.get(ENV) != name:
        return
    code = os.environ.get(ERRNO_ENV)
    if code:
        if not hasattr(errno, code):
            raise ValueError(f"{ERRNO_ENV}={code!r} is not an errno name (e.g. ENOSPC, EROFS)")
        num = getattr(errno, code)
        raise OSError(num, os.strerror(num), None if path is None else os.fspath(path))
    os.kill(os.getpid(), signal.SIGKILL)
