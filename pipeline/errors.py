"""Error types and the exit codes CI relies on (one table, also in the README).

| code | meaning |
|---:|---|
| 0 | passed |
| 1 | an accuracy gate failed, or an accuracy budget is unreachable |
| 2 | bad input: the recipe, a ``--set`` value, a data or model file, a pinned tuning result |
| 3 | internal error: a bug; the traceback is saved to ``error.log``; also a native crash
      of the TensorRT(-RTX) builder in its child process |
| 4 | environment: lock held, server failed to start, storage or network error
      (any ENOSPC, EDQUOT, EROFS or EXDEV: disk full, quota, read-only mount, a rename
      across file systems), out of memory (the builder's child SIGKILLed too), a published
      repository that fails verification |
| 130 | interrupted (Ctrl-C / SIGTERM) |

Every user-facing failure is a PipelineError whose message names the file,
field, input or node at fault and what would be valid.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

EXIT_PASSED = 0
EXIT_GATE_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_ENVIRONMENT = 4
EXIT_INTERRUPTED = 130


class PipelineError(Exception):
    """Base class: the CLI prints the message and exits with ``exit_code``."""

    exit_code = EXIT_BAD_INPUT


class RecipeError(PipelineError):
    """The recipe file is missing or breaks the schema."""


class ExportError(PipelineError):
    """Export failed, or the exported graph is not dynamic where it must be."""


class QuantizationError(PipelineError):
    """Q/DQ placement or calibration failed (bad exclusions, too little data)."""


class GraphCheckError(PipelineError):
    """A graph handed to TensorRT breaks a rule TensorRT enforces."""


class ProfileError(PipelineError):
    """Optimization profiles do not fit the graph's inputs."""


class TritonConfigError(PipelineError):
    """A generated config.pbtxt does not agree with the model it serves."""


class AccuracyError(PipelineError):
    """A comparison cannot be trusted (NaN in the reference, nothing compared)."""


class GateFailed(PipelineError):
    """An accuracy gate failed; the report says which metric and by how much."""

    exit_code = EXIT_GATE_FAILED


class EnvironmentFault(PipelineError):
    """The machine, not the input: a lock held, a server that does not start,
    storage or network errors, a published repository that fails verification."""

    exit_code = EXIT_ENVIRONMENT


class LockHeld(EnvironmentFault):
    """Another build of the same recipe holds the run lock."""


class RepositoryCorrupt(EnvironmentFault):
    """A published repository differs from its ``repository.json`` or is half-published."""


class MemoryFault(EnvironmentFault):
    """The process ran out of memory (a ``MemoryError``, ``ENOMEM``, or an allocator's failure in
    ONNX Runtime or torch): exit 4, with the stage, its peak resident memory and this machine's."""


class StorageFault(EnvironmentFault):
    """The file system refused a write: full (ENOSPC), over quota (EDQUOT), read-only
    (EROFS), or a rename across file systems (EXDEV)."""


#: errno -> (what it means, what to do); each is exit 4, never 2 or 3.
STORAGE_ERRNOS = {
    errno.ENOSPC: ("no space left on the device", "free space there or choose another folder, then rerun"),
    errno.EDQUOT: ("disk quota exceeded", "free space there or raise the quota, then rerun"),
    errno.EROFS: ("the file system is mounted read-only", "mount it read-write or choose another folder"),
    errno.EXDEV: ("a rename would cross file systems, so it cannot be atomic",
                  "keep the folder and what is renamed into it on one file system"),
}


def causes(exc: BaseException | None, *, past_from_none: bool = True):
    """``exc`` then each exception it was raised from (``__cause__``, else ``__context__``), each
    once; with ``past_from_none=False`` a ``raise ... from None`` ends the chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        suppressed = exc.__suppress_context__ and not past_from_none
        exc = exc.__cause__ or (None if suppressed else exc.__context__)


def storage_oserror(exc: BaseException | None) -> OSError | None:
    """The first OSError with an errno of :data:`STORAGE_ERRNOS` in ``exc`` or its
    ``__cause__`` / ``__context__`` chain, or None."""
    return next((e for e in causes(exc) if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS), None)


def storage_fault(exc: BaseException, folder: str | os.PathLike | None = None,
                  needed_bytes: int | None = None) -> StorageFault | None:
    """A :class:`StorageFault` for ``exc`` when its chain holds a storage errno (see
    :func:`storage_oserror`), else None. The message names the folder (``folder``, else
    the failing file's), the free space there (``shutil.disk_usage``) and, where the
    caller knows it, the space needed (``needed_bytes``)."""
    err = storage_oserror(exc)
    if err is None:
        return None
    where = Path(folder) if folder is not None else Path(err.filename).parent if err.filename else None
    meaning, advice = STORAGE_ERRNOS[err.errno]
    parts = [f"{where or 'a write'}: {meaning} ([Errno {err.errno}] {err.strerror}"
             + (f": {err.filename}" if err.filename else "") + ")"]
    if needed_bytes is not None:
        parts.append(f"needs {_mib(needed_bytes)}")
    free = _free_bytes(where)
    if free is not None and err.errno in (errno.ENOSPC, errno.EDQUOT):
        parts.append(f"{_mib(free)} free there")
    return StorageFault("; ".join(parts + [advice]))


def _free_bytes(folder: Path | None) -> int | None:
    while folder is not None and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free if folder is not None else None
    except OSError:
        return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class InternalError(PipelineError):
    """A bug in the pipeline (an unexpected exception); the CLI saves the traceback."""

    exit_code = EXIT_INTERNAL
