"""A stage cache shared by every runner, in S3-compatible storage.

    python -m pipeline build RECIPE --cache s3://bucket/prefix     (or PIPELINE_CACHE=s3://...)

The keys are the local stage cache's (:func:`pipeline.run.runner.stage_key`): they hash a
stage's recipe sections, its upstream keys, the tool versions it depends on, its own
code and the content of the model and data files, never a path or the CPU. Two
checkouts of one recipe in different folders, on different machines, get the same keys.

**Layout under the prefix**::

    blobs/sha256/<hex>        one file's bytes, named by their sha256 (x-amz-meta-sha256 too)
    stages/<stage>/<key>.json the entry: the stage's artifact (paths as ``${run_dir}`` /
                              ``${output_dir}``), its record, and every file as
                              {relative path: {sha256, size}}; for ``triton`` the models'
                              repository.json entries

**Pull** (a local miss whose entry exists): every file is downloaded into a new folder
and re-hashed; only when all match does it replace the stage's folder (for ``triton``:
the models are published into ``output_dir`` through the journaled publish,
:mod:`pipeline.triton.publish`). A missing blob, a wrong hash or an unreadable entry is
a miss with a warning, never a hit; the runner then runs the stage.

**Push** (a stage that ran): blobs first (a blob that exists is skipped: its name is its
content), the entry last, with a conditional put (``If-None-Match: *``), so the first
writer wins and an entry is never overwritten: two runners pushing one key at once both
succeed, one entry stays, and engines (not byte-reproducible) never mix. An entry only
exists once all its blobs do, so a push cut short leaves no entry.

**Credentials**: boto3's standard configuration, as :mod:`pipeline.remote.s3` (which
also parses the URL). Storage errors never fail a build: the stage runs (pull) or
stays local (push), with a warning in the console and the manifest's ``remote_cache``.

**An unreachable cache** costs a build seconds, not an hour. The client connects within
:data:`CONNECT_TIMEOUT_S`, waits at most :data:`READ_TIMEOUT_S` for each read and makes
:data:`ATTEMPTS` attempts per call (botocore's defaults, 60 s and 5 retries, made an endpoint
that accepts connections and never answers cost 6 minutes per call, and a build makes one or
more per stage: about an hour). The first timeout or refused connection switches the cache off for the rest
of the run, as Gradle's and sccache's remote caches do: one console line says so, every later
pull is a miss and every push is skipped without a call (``summary()["off"]`` names the cause).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

from pipeline.context import StageContext
from pipeline.errors import EnvironmentFault
from pipeline.remote.s3 import S3Location, s3_client, upload_object

FORMAT = 1
#: the cache client's limits (see the module docstring): seconds to connect, seconds per read
#: (not per object: a large blob streams in many reads), attempts per call (the first included)
CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ATTEMPTS = 5.0, 15.0, 2
ENV = "PIPELINE_CACHE"
RUN_DIR, OUTPUT_DIR = "${run_dir}", "${output_dir}"
_MARKER = "stage.json"  # the runner's local record, rewritten after a pull (pipeline.run.runner)


class RemoteCache:
    """The runner's shared stage cache at ``loc`` (see the module docstring).

    ``summary()`` is what the manifest's ``remote_cache`` holds: the URL, the stages
    pulled, pushed or already present, and one line per warning.
    """

    def __init__(self, loc: S3Location, client: Any = None, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 read_timeout_s: float = READ_TIMEOUT_S, attempts: int = ATTEMPTS):
        self.loc = loc
        self.url = loc.url
        self._client = client
        self._timeouts, self._attempts = (connect_timeout_s, read_timeout_s), attempts
        self.pulled: list[str] = []
        self.pushed: list[str] = []
        self.present: list[str] = []
        self.warnings: list[str] = []
        self.off: str | None = None  # why the cache is off for the rest of the run (unreachable), or None
        self._bad_blobs: set[str] = set()  # found corrupt on a pull: re-uploaded on the next push

    @classmethod
    def from_url(cls, url: str | None) -> "RemoteCache | None":
        """``--cache URL``, else ``$PIPELINE_CACHE``; None when neither is set.

        Raises:
            PipelineError: not an ``s3://bucket/prefix`` URL (exit 2).
        """
        url = url or os.environ.get(ENV) or None
        return None if url is None else cls(S3Location.parse(url, option="--cache"))

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.loc, connect_timeout_s=self._timeouts[0], read_timeout_s=self._timeouts[1],
                                     attempts=self._attempts)
        return self._client

    def summary(self) -> dict:
        return {"url": self.url, "pulled": self.pulled, "pushed": self.pushed, "present": self.present,
                "warnings": self.warnings, "off": self.off}

    def _switch_off(self, ctx: StageContext, e: BaseException) -> None:
        """The first timeout or unreachable endpoint: no further call this run (one console line)."""
        self.off = f"{ctx.stage}: {type(e).__name__}: {e}"
        text = (f"unreachable ({type(e).__name__}: {e}); the remote cache is off for the rest of this run "
                "(stages run here and stay in the local cache)")
        self.warnings.append(f"{ctx.stage}: {text}")
        ctx.progress.print(f"[yellow]warning[/yellow] {ctx.stage}: remote cache {self.url}: {text}")

    def entry_key(self, stage: str, key: str) -> str:
        return self.loc.key("stages", stage, f"{key}.json")

    def blob_key(self, sha256: str) -> str:
        return self.loc.key("blobs", "sha256", sha256)

    def _warn(self, ctx: StageContext, text: str) -> None:
        self.warnings.append(f"{ctx.stage}: {text}")
        ctx.progress.print(f"[yellow]warning[/yellow] {ctx.stage}: remote cache {self.url}: {text}")

    # --- pull ------------------------------------------------------------------------------------

    def pull(self, ctx: StageContext, key: str) -> dict | None:
        """Place the files of stage ``ctx.stage``'s entry for ``key`` and return its
        ``{"artifact", "record"}`` with this runner's paths; None on a miss (no entry, or a
        bad one: warned; or the cache is off). Never raises for storage, network or content problems."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        if self.off is not None:
            return None
        try:
            entry = self._entry(ctx.stage, key)
            if entry is None:
                return None
            problem = _entry_problem(entry, ctx.stage, key)
            if problem is None:
                problem = self._place(ctx, entry)
            if problem is None:
                places = _places(ctx)
                found = {"artifact": _expand(entry["artifact"], places), "record": _expand(entry["record"], places)}
        # an entry is another runner's data: whatever shape it has, a bad one is a miss
        except _unreachable() as e:
            self._switch_off(ctx, e)
            return None
        except (Boto3Error, BotoCoreError, ClientError, EnvironmentFault, OSError, ValueError, KeyError, TypeError,
                AttributeError) as e:
            problem = f"pull failed ({type(e).__name__}: {e})"
        if problem:
            self._warn(ctx, f"{problem}; treated as a miss, the stage runs here")
            return None
        self.pulled.append(ctx.stage)
        return found

    def _entry(self, stage: str, key: str) -> dict | None:
        from pipeline.remote.s3 import read_object

        data = read_object(self.client, self.loc.bucket, self.entry_key(stage, key))
        return None if data is None else json.loads(data)

    def _place(self, ctx: StageContext, entry: dict) -> str | None:
        """Download and verify every file, then put them in place; the problem, or None."""
        stage_dir = ctx.run_dir / ctx.stage
        tmp = ctx.run_dir / f".{ctx.stage}.remote-{uuid.uuid4().hex[:8]}"
        try:
            problem = self._download_all(entry["files"], tmp)
            if problem is None and ctx.stage == "triton":
                problem = self._place_models(ctx, entry)
            if problem is None:
                shutil.rmtree(stage_dir, ignore_errors=True)
                tmp.rename(stage_dir)
            return problem
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _place_models(self, ctx: StageContext, entry: dict) -> str | None:
        """Stage the models, verify them, publish them into ``output_dir`` as one unit."""
        from pipeline.triton import publish
        from pipeline.triton.repository import staging_folder

        out_dir, name = Path(ctx.recipe.output_dir), ctx.recipe.name
        with staging_folder(out_dir, name) as staging:
            problem = self._download_all(entry["models"], staging)
            if problem is None:
                index = entry["index"]
                wrong = [m for m, e in index.items() if e.get("files") != publish.tree_hashes(staging / m)]
                if wrong:
                    return f"models {wrong}: files differ from their repository.json entries"
                publish.publish(staging, out_dir, {m: {**e, "recipe": name} for m, e in index.items()}, name)
            return problem

    def _download_all(self, files: dict[str, dict], dest: Path) -> str | None:
        for rel, meta in sorted(files.items()):
            path = dest / rel
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                return f"entry names the file {rel!r} outside the stage folder"
            path.parent.mkdir(parents=True, exist_ok=True)
            problem = self._download(meta["sha256"], path)
            if problem:
                return f"{rel}: {problem}"
        return None

    def _download(self, sha256: str, path: Path) -> str | None:
        """Stream blob ``sha256`` into ``path``, hashing it; the problem, or None."""
        from botocore.exceptions import ClientError

        key = self.blob_key(sha256)
        try:
            obj = self.client.get_object(Bucket=self.loc.bucket, Key=key)
        except ClientError as e:
            return f"s3://{self.loc.bucket}/{key}: cannot be read ({e.response.get('Error', {}).get('Code', e)})"
        h = hashlib.sha256()
        with open(path, "wb") as fh:
            for chunk in iter(lambda: obj["Body"].read(1 << 22), b""):
                h.update(chunk)
                fh.write(chunk)
        if h.hexdigest() != sha256:
            self._bad_blobs.add(sha256)
            return (f"s3://{self.loc.bucket}/{key}: corrupt or partial (its bytes hash to {h.hexdigest()[:12]}, "
                    f"{path.stat().st_size} bytes)")
        return None

    # --- push ------------------------------------------------------------------------------------

    def push(self, ctx: StageContext, key: str, stage_json: dict) -> str:
        """Upload stage ``ctx.stage``'s files and its entry for ``key``, unless an entry
        exists (the first writer wins). Returns ``"pushed"``, ``"present"``, ``"failed"``
        (warned) or ``"off"`` (the cache is off: no call). Never raises for storage or network problems."""
        from boto3.exceptions import Boto3Error  # S3UploadFailedError: a bucket that refuses the upload
        from botocore.exceptions import BotoCoreError, ClientError

        if self.off is not None:
            return "off"
        try:
            entry = self._new_entry(ctx, key, stage_json)
            blobs = self._blobs(ctx, entry)
            if self._exists(self.entry_key(ctx.stage, key)):  # another runner's: repair what a pull found corrupt
                for sha256 in self._bad_blobs & set(blobs):
                    self._upload_blob(blobs[sha256], sha256)
                self.present.append(ctx.stage)
                return "present"
            for sha256, path in blobs.items():
                self._upload_blob(path, sha256)
            won = self._put_entry(ctx.stage, key, entry)
        except _unreachable() as e:
            self._switch_off(ctx, e)
            return "off"
        except (Boto3Error, BotoCoreError, ClientError, EnvironmentFault, OSError, ValueError) as e:
            self._warn(ctx, f"push failed ({type(e).__name__}: {e}); the stage stays in the local cache only")
            return "failed"
        (self.pushed if won else self.present).append(ctx.stage)
        return "pushed" if won else "present"

    def _new_entry(self, ctx: StageContext, key: str, stage_json: dict) -> dict:
        from pipeline.triton import publish

        art = stage_json["artifact"]
        root = ctx.run_dir / ctx.stage
        files = _described({p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
                            if p.is_file() and p.relative_to(root).as_posix() != _MARKER})
        models: dict[str, dict] = {}
        index: dict[str, dict] = {}
        if ctx.stage == "triton":
            repo = Path(ctx.recipe.output_dir)
            whole = publish.read_index(repo)
            index = {m: {k: v for k, v in whole[m].items() if k != "recipe"} for m in art["models"]}
            models = _described({f"{m}/{rel}": repo / m / rel for m in art["models"] for rel in whole[m]["files"]})
        places = _places(ctx)
        return {"format": FORMAT, "stage": ctx.stage, "key": key, "artifact": _relocate(art, places),
                "record": _relocate(stage_json["record"], places), "files": files, "models": models,
                "index": index, "pushed_by": socket.gethostname()}

    def _blobs(self, ctx: StageContext, entry: dict) -> dict[str, Path]:
        """sha256 -> a local file with those bytes, for every file of ``entry``."""
        root, repo = ctx.run_dir / ctx.stage, Path(ctx.recipe.output_dir)
        out = {m["sha256"]: root / rel for rel, m in entry["files"].items()}
        return {**out, **{m["sha256"]: repo / rel for rel, m in entry["models"].items()}}

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.loc.bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def _upload_blob(self, path: Path, sha256: str) -> None:
        """Upload unless there (content-named: what is there is these bytes, and a pull
        re-hashes it anyway), or a pull found it corrupt."""
        key = self.blob_key(sha256)
        if sha256 in self._bad_blobs or not self._exists(key):
            upload_object(self.client, self.loc.bucket, path, key, sha256)
        self._bad_blobs.discard(sha256)

    def _put_entry(self, stage: str, key: str, entry: dict) -> bool:
        """The conditional put of the entry: True when this runner wrote it, False when
        another runner's entry was there first (HTTP 412, or 409 for a concurrent one)."""
        from botocore.exceptions import ClientError

        data = json.dumps(entry, indent=1, sort_keys=True).encode()
        try:
            self.client.put_object(Bucket=self.loc.bucket, Key=self.entry_key(stage, key), Body=data,
                                   IfNoneMatch="*", Metadata={"sha256": hashlib.sha256(data).hexdigest()})
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return False
            raise
        return True


def _unreachable() -> tuple[type[BaseException], ...]:
    """botocore's errors for an endpoint that refuses, drops or never answers: connect and
    read timeouts, refused or closed connections (not an S3 error response: that endpoint answered)."""
    from botocore.exceptions import ConnectionClosedError, ReadTimeoutError
    from botocore.exceptions import ConnectionError as EndpointUnreachable  # connect timeout, refused, proxy

    return (EndpointUnreachable, ReadTimeoutError, ConnectionClosedError)


def _described(paths: dict[str, Path]) -> dict[str, dict]:
    """relative path -> {sha256, size} of each file."""
    from pipeline.fsutil import file_sha256

    return {rel: {"sha256": file_sha256(p), "size": p.stat().st_size} for rel, p in paths.items()}


def _places(ctx: StageContext) -> dict[str, str]:
    """Placeholder -> this runner's folder: the run folder and the model repository."""
    return {RUN_DIR: str(ctx.run_dir), OUTPUT_DIR: str(ctx.recipe.output_dir)}


def _relocate(obj: Any, places: dict[str, str]) -> Any:
    """``obj`` (JSON) with this runner's folders of ``places``, wherever a string names them
    (a path, or a note such as "ONNX graph <path> in ONNX Runtime"), written as their placeholders."""
    pairs = [(re.compile(re.escape(base) + r"(?![\w.-])"), mark) for mark, folder in places.items()
             for base in dict.fromkeys((folder, str(Path(folder).resolve())))]
    return _map_strings(obj, sorted(pairs, key=lambda p: -len(p[0].pattern)))


def _expand(obj: Any, places: dict[str, str]) -> Any:
    """The inverse of :func:`_relocate`: placeholders -> this runner's folders."""
    return _map_strings(obj, [(re.compile(re.escape(mark)), folder) for mark, folder in places.items()])


def _map_strings(obj: Any, pairs: list[tuple[re.Pattern, str]]) -> Any:
    if isinstance(obj, dict):
        return {k: _map_strings(v, pairs) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_strings(v, pairs) for v in obj]
    if isinstance(obj, str):
        for pattern, text in pairs:
            obj = pattern.sub(lambda _m, text=text: text, obj)
    return obj


def _entry_problem(entry: dict, stage: str, key: str) -> str | None:
    """Why an entry cannot be used (None: it can)."""
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return f"entry of format {entry.get('format') if isinstance(entry, dict) else '?'}, not {FORMAT}"
    if entry.get("stage") != stage or entry.get("key") != key:
        return f"entry names stage {entry.get('stage')!r} key {str(entry.get('key'))[:12]}, not {stage!r} {key[:12]}"
    if not isinstance(entry.get("record"), dict) or "status" not in entry["record"] or "artifact" not in entry:
        return "entry has no artifact or no stage record"
    for part in ("files", "models"):
        if not isinstance(entry.get(part), dict) or not all("sha256" in m for m in entry[part].values()):
            return f"entry's {part!r} is not a list of files with their sha256"
    return None
