"""Fault injection for crash tests: ``PIPELINE_FAULT=<point>`` makes the process
SIGKILL itself when it reaches that point, as a power cut or the OOM killer would.

Points: ``stage:<name>:start`` / ``stage:<name>:end`` (before a stage runs; after
it wrote its outputs, before its cache record), and the publish steps
``publish:journal``, ``publish:model:<i>``, ``publish:stale``, ``publish:index``,
``publish:cleanup`` (see :mod:`pipeline.triton.publish`).
"""
from __future__ import annotations

import os
import signal

ENV = "PIPELINE_FAULT"


def fault_point(name: str) -> None:
    """SIGKILL this process when ``$PIPELINE_FAULT`` equals ``name``; else nothing."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
