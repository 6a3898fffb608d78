"""Run the tritonserver shipped in the nvidia-pytriton wheel on a model repository.

The wheel carries ``pytriton/tritonserver/bin/tritonserver`` (python backend
only, plus whatever backends the host adds), its shared libraries in
``nvidia_pytriton.libs`` and one python-backend stub per Python version. As
pytriton itself does, :func:`start_server` builds a backend folder holding the
stub for *this* interpreter, puts the libraries on ``LD_LIBRARY_PATH`` and this
interpreter's ``bin`` first on ``PATH`` (the stub embeds the system
``libpython3.X`` and finds this environment's packages through it; they need
numpy<2). The server listens on 127.0.0.1 only, on free ports, with a python
backend shared-memory prefix unique to the process.

The python backend starts each model's stub through ``bash -c`` with the stub's, the
``model.py``'s and the backend folder's paths unquoted, and the stub runs Python isolated
with ASCII file names: a path holding a space, a shell character or a non-ASCII letter
never reaches a running stub. Such a path (a repository, the backend folder) is handed to
tritonserver as a symlink in a temporary folder of a plain path (:func:`stub_safe`); a stub
that cannot start ends the readiness wait at once (its shell's error in the log), not at
its timeout.

    with start_server(repo, models=["m"]) as server:
        httpclient.InferenceServerClient(server.http_url) ...
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pipeline.errors import EnvironmentFault

SHM_DIR = Path("/dev/shm")
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # ignore http_proxy for 127.0.0.1


class TritonServerError(EnvironmentFault):
    """tritonserver is missing, cannot be given a path, exited, or did not become ready in time,
    or a model's stub could not start (exit 4: the environment)."""


#: What a path handed to the python backend's stub may hold (:func:`stub_safe`).
_STUB_SAFE = re.compile(r"[A-Za-z0-9_./+:@%,=-]*")
#: Log lines of a python-backend stub that did not start: the shell its launcher runs (``bash -c
#: "<stub> <model.py> ..."``) failing, or the backend's own launch errors. tritonserver keeps
#: waiting for such a stub (its stub timeout, model after model), so one ends the readiness wait.
_STUB_FAILED = re.compile(r"^(?:bash: .*|.*(?:Failed to run python backend stub|Launch stub process failed).*)$",
                          re.MULTILINE)
#: Where a folder of symlinks to paths the stub cannot take is made: the first of these with a
#: stub-safe path that can hold one.
_LINK_PARENTS = (tempfile.gettempdir, lambda: "/tmp", lambda: "/var/tmp", lambda: "/dev/shm")


def stub_safe(path: str | Path) -> bool:
    """``path`` can be handed to a python-backend stub as it is: only ASCII letters, digits and
    ``_./+:@%,=-``. The backend starts the stub with ``bash -c`` and the paths unquoted (a space
    splits one, ``$`` or ``;`` would be run), and the stub's Python decodes file names as ASCII
    (it runs isolated, in the C locale: a Cyrillic folder is a UnicodeEncodeError)."""
    return _STUB_SAFE.fullmatch(str(path)) is not None


@dataclass(frozen=True)
class ServerDist:
    """Paths of the tritonserver distribution inside the pytriton wheel."""

    binary: Path
    libs: Path
    python_backend: Path  # libtriton_python.so, triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub for this interpreter's version

    @property
    def backends(self) -> list[str]:
        """Backends this server can load: the folders of its ``backends/`` directory
        (the pytriton wheel ships only ``python``; no ``onnxruntime``, no ``tensorrt``)."""
        return sorted(p.name for p in self.python_backend.parent.iterdir() if p.is_dir() and not p.name.startswith("_"))


def find_server() -> ServerDist:
    """Locate tritonserver in the installed nvidia-pytriton wheel.

    Raises:
        TritonServerError: pytriton is not installed, or has no binary or no
            python-backend stub for this Python version.
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonServerError("tritonserver: nvidia-pytriton is not installed (pip install nvidia-pytriton)")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    libs = root / "external_libs"
    if not libs.is_dir():
        libs = root.parent.parent / "nvidia_pytriton.libs"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    dist = ServerDist(
        binary=root / "bin" / "tritonserver",
        libs=libs,
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
    )
    for path in (dist.binary, dist.stub, dist.python_backend / "libtriton_python.so"):
        if not path.is_file():
            raise TritonServerError(f"tritonserver: {path} not found in the nvidia-pytriton wheel")
    return dist


@dataclass
class TritonServer:
    """A running tritonserver; stop it with :meth:`stop` or a ``with`` block."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    shm_prefix: str
    workdir: Path
    owns_workdir: bool = False  # a temporary workdir is removed by stop()
    _log_file: IO[str] | None = field(repr=False, default=None)
    links: Path | None = None  # symlinks to the paths the stub cannot take (:func:`stub_safe`), removed by stop()

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def wait_ready(self, models: Sequence[str] = (), timeout_s: float = 120.0) -> None:
        """Poll ``/v2/health/ready`` and each model's ``/ready`` until all answer 200.

        Raises:
            TritonServerError: the process exited, a model's stub could not start
                (:data:`_STUB_FAILED` in the log), or not ready within ``timeout_s``; the
                message ends with the log tail.
        """
        paths = ["/v2/health/ready", *(f"/v2/models/{m}/ready" for m in models)]
        deadline = time.monotonic() + timeout_s
        while not all(self._http_ok(p) for p in paths):
            status = self._peek_exit()
            if status is not None:
                raise TritonServerError(f"tritonserver exited with status {status}:\n{self._tail()}")
            failed = _STUB_FAILED.search(self.logs())
            if failed is not None:
                raise TritonServerError(f"tritonserver: the python backend could not start a model's stub "
                                        f"({failed.group(0).strip()}); the server is stopped:\n{self._tail()}")
            if time.monotonic() > deadline:
                raise TritonServerError(f"tritonserver not ready after {timeout_s:.0f}s ({paths}):\n{self._tail()}")
            time.sleep(0.25)

    def stop(self, timeout_s: float = 45.0) -> int:
        """Stop the server and everything it started; idempotent.

        SIGINT, up to ``timeout_s`` (longer than the exit timeout) for a clean exit, then SIGKILL. Before the
        exited server is reaped (so its pid, the process-group id, cannot be
        reused), any member left in its process group (python-backend stubs) is
        SIGKILLed. Then this server's shared-memory regions and backend folder
        (the whole workdir if :func:`start_server` created it) are removed.
        Clients still connected make tritonserver wait its exit timeout and
        exit with code 1. Returns the server's exit code.
        """
        if self.process.returncode is None:
            if not self._exited(0):
                self.process.send_signal(signal.SIGINT)
                if not self._exited(timeout_s):
                    self.process.kill()
            self._kill_group()
            self.process.wait()
        if self._log_file is not None:
            self._log_file.close()
        for leftover in SHM_DIR.glob(f"{self.shm_prefix}*"):
            leftover.unlink(missing_ok=True)
        shutil.rmtree(self.workdir if self.owns_workdir else self.workdir / "backends", ignore_errors=True)
        if self.links is not None:
            shutil.rmtree(self.links, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _exited(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the server to exit, without reaping it."""
        deadline = time.monotonic() + timeout_s
        while self._peek_exit() is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _peek_exit(self) -> int | None:
        """Exit status (or signal number) if the server has exited, else None; does not reap."""
        if self.process.returncode is not None:
            return self.process.returncode
        info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        return None if info is None else info.si_status

    def _kill_group(self) -> None:
        """SIGKILL what is left of the process group this (unreaped) server leads."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _http_ok(self, path: str) -> bool:
        try:
            with _NO_PROXY.open(f"http://{self.http_url}{path}", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _tail(self, lines: int = 40) -> str:
        return "\n".join(self.logs().splitlines()[-lines:])


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (bound together, then released)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_server(
    repository: str | Path | Sequence[str | Path],
    *,
    models: Sequence[str] = (),
    explicit: bool = False,
    timeout_s: float = 120.0,
    workdir: str | Path | None = None,
    exit_timeout_s: int = 30,
    log_verbose: int = 0,
    shm_default_byte_size: int = 4 * 1024 * 1024,
    shm_growth_byte_size: int = 4 * 1024 * 1024,
    extra_args: Sequence[str] = (),
) -> TritonServer:
    """Start tritonserver on ``repository`` (all its models load) and wait until ready.

    Args:
        repository: model repository folder or URL (``s3://host:port/bucket/prefix``),
            or several (Triton merges them; model names must be unique across them).
        models: models that must report ready (besides server readiness).
        explicit: ``--model-control-mode=explicit``: only ``models`` load at
            start; the others are loaded and unloaded by the client
            (``load_model`` / ``unload_model``).
        timeout_s: readiness deadline; the server is stopped when it passes.
        workdir: where the backend folder (unless its path is not :func:`stub_safe`: then in the
            folder of links) and ``tritonserver.log`` go; the log is kept after stop. Default: a
            temporary folder, removed by stop.
        exit_timeout_s: how long tritonserver waits for in-flight requests,
            open connections and model unloads when stopped (Triton's own default,
            30 s: a python-backend model unloads in ~2 s, but more than 10 s was seen
            on a CPU shared by several builds).
        shm_default_byte_size, shm_growth_byte_size: python backend shared
            memory per model instance (small: /dev/shm is often 64 MiB in containers).
        extra_args: more tritonserver flags.

    Raises:
        TritonServerError: (exit 4) no server in the wheel; a path the stubs cannot take and no
            temporary folder to link it from (names it, before starting); it exited, a model's
            stub could not start, or it was not ready in time (message ends with the log tail).
    """
    dist = find_server()
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="tritonserver-"))
    work.mkdir(parents=True, exist_ok=True)
    links = _Links()
    try:
        repositories = [repository] if isinstance(repository, (str, Path)) else list(repository)
        repo_args = [links.path(_repository_arg(r), f"repository-{i}", "the model repository")
                     for i, r in enumerate(repositories)]
        backends = _backend_dir(dist, links.folder_for(work.resolve(), "the server's work folder"))
    except BaseException:
        links.remove()
        raise
    http, grpc, metrics = free_ports(3)
    prefix = f"trtpipe{os.getpid()}-{secrets.token_hex(4)}-"
    control = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)] if explicit else []
    cmd = [
        str(dist.binary), *(f"--model-repository={r}" for r in repo_args), *control,
        f"--backend-directory={backends}", "--http-address=127.0.0.1", f"--http-port={http}",
        "--grpc-address=127.0.0.1", f"--grpc-port={grpc}", "--metrics-address=127.0.0.1",
        f"--metrics-port={metrics}", f"--exit-timeout-secs={exit_timeout_s}", f"--log-verbose={log_verbose}",
        f"--backend-config=python,shm-region-prefix-name={prefix}",
        f"--backend-config=python,shm-default-byte-size={shm_default_byte_size}",
        f"--backend-config=python,shm-growth-byte-size={shm_growth_byte_size}", *extra_args,
    ]
    log_path = work / "tritonserver.log"
    log_file = log_path.open("w")
    try:
        process = subprocess.Popen(cmd, env=_server_env(dist), stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as e:
        log_file.close()
        links.remove()
        raise TritonServerError(f"tritonserver: cannot start {dist.binary}: {e}") from e
    server = TritonServer(process, http, grpc, metrics, log_path, prefix, work, workdir is None, log_file, links.folder)
    try:
        server.wait_ready(models, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


class _Links:
    """Symlinks, in one temporary folder of a stub-safe path (made on first need), to the paths a
    python-backend stub cannot take as they are (:func:`stub_safe`); the others are used as given."""

    def __init__(self) -> None:
        self.folder: Path | None = None

    def path(self, path: str, name: str, what: str) -> str:
        """``path`` (absolute, or a URL, given back as it is) when the stub can take it, else a
        symlink ``name`` to it in :attr:`folder`.

        Raises:
            TritonServerError: no temporary folder can hold the link (names ``what`` and ``path``).
        """
        if "://" in path or stub_safe(path):
            return path
        link = self._folder(path, what) / name
        link.symlink_to(path, target_is_directory=True)
        return str(link)

    def folder_for(self, path: Path, what: str) -> Path:
        """``path`` when the stub can take it, else :attr:`folder` (to make what goes there in it)."""
        return path if stub_safe(path) else self._folder(str(path), what)

    def remove(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _folder(self, path: str, what: str) -> Path:
        if self.folder is not None:
            return self.folder
        tried = []
        for parent in dict.fromkeys(p() for p in _LINK_PARENTS):
            if not stub_safe(parent):
                tried.append(f"{parent} (not a plain path)")
                continue
            try:
                self.folder = Path(tempfile.mkdtemp(prefix="trtpipe-links-", dir=parent))
                return self.folder
            except OSError as e:
                tried.append(f"{parent} ({e.strerror})")
        raise TritonServerError(
            f"tritonserver: {what}, {path}, holds a space, a shell character or a non-ASCII letter, which the "
            "python backend cannot hand to its stubs (it starts them with `bash -c` and the paths unquoted, and "
            "they read file names as ASCII), and no temporary folder can hold a link to it: tried "
            f"{', '.join(tried)}. Set TMPDIR to a writable folder whose path has only ASCII letters, digits and "
            "_./+:@%,=-, or move it to such a path")


def _repository_arg(repository: str | Path) -> str:
    """A local folder as an absolute path; a URL (``s3://host:port/bucket/prefix``, ``gs://``,
    ``as://``) as given. Triton reads S3 credentials from ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION`` in this process's environment."""
    text = str(repository)
    return text if "://" in text else str(Path(text).resolve())


def _backend_dir(dist: ServerDist, work: Path) -> Path:
    """``work/backends``: ``python/`` with links to the wheel's python backend and this
    Python's stub; every other backend folder of the wheel linked as it is."""
    root = work / "backends"
    python = root / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in [*dist.python_backend.iterdir(), dist.stub]:
        if source.is_file():
            link = python / source.name
            link.unlink(missing_ok=True)
            link.symlink_to(source)
    for name in dist.backends:
        if name != "python" and not (root / name).exists():
            (root / name).symlink_to(dist.python_backend.parent / name)
    return root


def _server_env(dist: ServerDist) -> dict[str, str]:
    env = os.environ.copy()
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (env.get("LD_LIBRARY_PATH"), str(dist.libs)) if p)
    env["PATH"] = f"{Path(sys.exec_prefix) / 'bin'}:{env.get('PATH', '')}"
    return env


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the starting process dies (Linux prctl PR_SET_PDEATHSIG)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        ctypes.CDLL(libc_name, use_errno=True).prctl(1, signal.SIGTERM)
