"""Atomic file-system publishing helpers."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pipeline.faults import fault_point

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


def _renameat2():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``).

    A reader sees either the old or the new entry at each path, never neither
    and never a partial one. Returns False where the kernel, file system or C
    library cannot do it, so the caller can fall back to two renames.

    Raises:
        OSError: the exchange was possible but failed (e.g. a path is missing).
    """
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), f"{a} <-> {b}")


_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def copy_file(source: Path, dest: Path) -> None:
    """Copy ``source`` to a new file ``dest`` (reflink where the file system can,
    else a byte copy). Never a hard link: a published file must not share its
    inode with a stage output that a later run rewrites.

    Raises:
        FileNotFoundError: ``source`` does not exist.
        FileExistsError: ``dest`` exists.
    """
    import fcntl
    import shutil

    with open(source, "rb") as src, open(dest, "xb") as dst:
        fault_point(f"copy:{Path(dest).name}", dest)
        try:
            fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
        except OSError:
            shutil.copyfileobj(src, dst, 1 << 22)
    shutil.copystat(source, dest)


def file_sha256(path: Path) -> str:
    """sha256 hex digest of a file's bytes, read in 4 MiB blocks (never memoised:
    verification must see what is on disk now)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_file(path: str | Path, _cache: dict = {}) -> str:
    """sha256 hex digest of a file (:func:`file_sha256`), memoised on
    (path, size, mtime): for stage keys, which hash the same large files many times.
    Verification of published files uses the unmemoised one."""
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _cache:
        _cache[key] = file_sha256(Path(path))
    return _cache[key]


def scratch_prefix(path: Path) -> str:
    """Name prefix of the scratch file or folder a write of ``path`` makes beside it
    (``.<name>.tmp-``); what a killed writer leaves, :func:`remove_scratch` removes."""
    return f".{path.name}.tmp-"


def remove_scratch(folder: Path) -> list[str]:
    """Remove what killed writers left in ``folder`` (names starting ``.`` and holding
    ``.tmp-``, :func:`scratch_prefix`); call only while no writer runs there (the run
    lock). Returns the names removed."""
    import shutil

    if not folder.is_dir():
        return []
    gone = sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and ".tmp-" in p.name)
    for name in gone:
        p = folder / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone


def write_atomic(path: str | Path, write: Callable[[BinaryIO], None], *, durable: bool = False) -> None:
    """Replace ``path`` atomically with what ``write(fh)`` writes to a binary file: a temp
    file in the same folder (mode 0644), then ``os.replace``; a reader sees the old or the
    new file, never a partial one. The folder is created if missing. The one atomic-write
    helper (text, JSON, engine plans, feed archives).

    ``durable=True`` also fsyncs the file before the rename and the folder after it
    (a crash right after return keeps the new file: the publish journal and index).

    Raises:
        OSError: the folder cannot be created or written; the temp file is removed.
        Whatever ``write`` raises; the temp file is removed and ``path`` is untouched.
    """
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=scratch_prefix(path))
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide reports and indexes from other users
        with os.fdopen(fd, "wb") as fh:
            fault_point(f"write:{path.name}", path)
            write(fh)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_bytes_atomic(path: str | Path, data: bytes | memoryview, *, durable: bool = False) -> None:
    """:func:`write_atomic` of ``data``."""
    write_atomic(path, lambda fh: fh.write(data), durable=durable)


def write_text_atomic(path: str | Path, text: str, *, durable: bool = False) -> None:
    """:func:`write_atomic` of ``text`` encoded as UTF-8 (a lone surrogate, from a file name
    that is not UTF-8, is written as its ``\\udcxx`` escape rather than failing the write)."""
    write_atomic(path, lambda fh: fh.write(text.encode("utf-8", "backslashreplace")), durable=durable)


REASON_SUFFIX = "_reason"


def nonfinite_reason(value: float) -> str:
    """The ``<key>_reason`` text for a NaN/inf float that strict JSON writes as null."""
    return f"not a finite number ({value!r})"


def _clean(value):
    """``value`` with numpy scalars made Python ones and non-finite floats made None."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return strict_jsonable(value) if isinstance(value, (dict, list, tuple)) else value


def strict_jsonable(data):
    """A copy of ``data`` (dicts, lists, tuples, scalars) that strict JSON can hold:
    every NaN/inf float (numpy scalars included) becomes ``None``. In a dict, a
    key ``k`` that lost its value gets ``k + "_reason"`` unless the producer
    already set one (e.g. "the naive_ort model gave 384 non-finite embeddings");
    a list that lost an element gets the reason under its own key.

    Returns the new object; the input is not changed.
    """
    if isinstance(data, dict):
        out: dict = {}
        for k, v in data.items():
            out[k] = _clean(v)
            reason_key = f"{k}{REASON_SUFFIX}"
            if reason_key in data or not isinstance(k, str):
                continue
            if out[k] is None and v is not None:
                out[reason_key] = nonfinite_reason(float(v))
            elif isinstance(v, (list, tuple)) and _lost(v, out[k]):
                out[reason_key] = f"elements {_lost(v, out[k])} were not finite numbers (written as null)"
        return out
    if isinstance(data, (list, tuple)):
        return [_clean(v) for v in data]
    return _clean(data)


def _lost(before, after) -> list[int]:
    """Indices where a list element was a value and became None."""
    return [i for i, (a, b) in enumerate(zip(before, after)) if a is not None and b is None]


def write_json_atomic(path: Path, data: dict, *, strict: bool = True) -> None:
    """Write ``data`` as indented JSON via a temp file and rename.

    ``strict=True`` (metrics.json, manifest.json, bench.json): sanitised with
    :func:`strict_jsonable` first, then dumped with ``allow_nan=False``, so the
    file is strict JSON (RFC 8259) that any parser reads; the default, also for
    the stage cache (``GateResult.value`` reads ``null`` back as NaN).
    ``strict=False`` keeps Python's NaN/Infinity tokens.
    Objects JSON does not know are written as ``str(obj)``.

    Raises:
        ValueError: a non-finite float the sanitiser cannot reach (a NaN dict
            key); nothing is written.
    """
    if strict:
        text = json.dumps(strict_jsonable(data), indent=2, default=str, allow_nan=False)
    else:
        text = json.dumps(data, indent=2, default=str)
    write_text_atomic(path, text)


def user_path(value: str) -> str:
    """``value`` with a leading ``~`` or ``~user`` expanded to that home folder (:func:`os.path.expanduser`),
    as a shell expands it: the one place a path typed into a recipe (``work_dir``, ``output_dir``, a model
    or data file) or on the command line (``deploy --out``) gets it, so none becomes a folder named ``~``."""
    return os.path.expanduser(value)


def folder_problem(path: str | Path) -> OSError | str | None:
    """Why ``path`` cannot be (or become) a folder this process writes into, without leaving
    anything behind: a file is in the way (a message), or a probe folder cannot be made in its
    nearest existing ancestor (the OSError: EROFS, EACCES, ENOENT under ``/proc``...); None when
    it can."""
    import tempfile

    p = Path(path).absolute()
    near = p
    while not near.exists() and near != near.parent:
        if near.is_symlink():
            return f"{near} is a symlink to a missing {os.readlink(near)}"
        near = near.parent
    if not near.is_dir():
        return f"{near} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=near))
    except OSError as e:
        return e
    return None
