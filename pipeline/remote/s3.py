"""Publish one recipe's models to S3-compatible storage as a new Triton model version.

    python -m pipeline publish RECIPE --to s3://bucket/prefix [--serve-copy] [--rollback]

**Which local folder.** By default ``recipe.output_dir`` (``model_repository/``):
the repository for a stock Triton container (``tensorrt_plan`` or
``onnxruntime_onnx`` compute model). ``--serve-copy`` publishes
``<work_dir>/<recipe>/serve_repository/`` instead, the ``python-onnxruntime``
copy that ``python -m pipeline serve`` writes
(:mod:`pipeline.serve.prepare`), for the tritonserver of the pytriton wheel,
which has only the python backend. Only the recipe's models (its
``repository.json`` entries) are published.

**Gate.** The recipe's last run (``<work_dir>/<recipe>/manifest.json``) must
have ``verdict: pass`` (else :class:`~pipeline.errors.GateFailed`, exit 1) and
the local folder must re-hash to its ``repository.json``
(:func:`pipeline.triton.publish.verify_repository`; else
:class:`~pipeline.errors.RepositoryCorrupt`, exit 4). Storage and network
errors are :class:`~pipeline.errors.EnvironmentFault` (exit 4). The recipe's
run lock is held throughout, so a build of the recipe cannot change the
folder mid-upload.

**Credentials and endpoint.** boto3's standard configuration: environment
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``), ``AWS_PROFILE`` / shared config files, instance
roles; ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for an
S3-compatible store. ``--to`` also takes Triton's own URL form with the
endpoint in it: ``s3://host:port/bucket/prefix`` (http) or
``s3://https://host:port/bucket/prefix``.

**Layout under the prefix** (a Triton model repository)::

    <model>/config.pbtxt                   the live config: version_policy { specific { versions: [N] } }
    <model>/<N>/...                        version N's files; never rewritten. Each object carries
                                           its sha256 as user metadata (x-amz-meta-sha256)
    <model>/<N>/trt-pipeline-version.json  written once every object of N re-hashed: the files'
                                           sha256 and version N's whole config (the completion mark)

**Steps of a publish.** (1) N = 1 + the highest version folder of any of the
recipe's models (a folder left by a failed publish is never reused);
(2) upload every file of each model's local version folder to ``<model>/<N>/``;
(3) download every uploaded object again and compare its sha256 with the local
file's (and with its metadata); (4) write each ``trt-pipeline-version.json``;
(5) make N live: rewrite each ``<model>/config.pbtxt`` with
``version_policy: specific [N]``, the recipe's front model (the LLM's
generation model, the encoder's ensemble) last. A failure or a kill in 1-4
leaves every live config untouched: the live version stays what it was, and
a server that reloads still gets it. Step 5 writes one small object per
model; a kill inside it leaves some models at N and the rest at N-1 (the
front model still at N-1): run the publish again (it makes N+1 live) or
``--rollback``.

**Rollback** (``--rollback``) is step 5 pointing at the highest complete version
below the live one (it has a ``trt-pipeline-version.json`` for every model),
after re-hashing its objects against that record.

**Config changes across versions.** Triton keeps one ``config.pbtxt`` per model
for all its versions. Each version's record therefore holds its whole config,
and making a version live writes that config, not only ``version_policy``:
a change of inputs, batching or backend between versions rolls back too.

**Ensembles and BLS.** A Triton ensemble step names a model version
(``model_version: -1`` = the latest *loaded* one). ``version_policy: specific``
on every component already makes exactly one version loadable, so -1 would
resolve to it. We still pin: the published ensemble config of version N runs
its components at version N, so a half-finished step 5 makes the ensemble fail
to load instead of silently mixing a tokenizer of one version with a compute
model of another. The LLM generation model calls the compute model through BLS
without a version (latest loaded), which the compute model's
``specific`` policy makes the live one.

**Servers.** A tritonserver started with ``--model-control-mode=poll`` picks the
new config up at its next poll; with ``explicit``, load each model again
(``POST /v2/repository/models/<model>/load``, the front model last); with
``none``, restart it. Triton downloads a model's whole folder (every version)
when it loads it from S3, so remove versions no rollback needs
(``aws s3 rm --recursive s3://bucket/prefix/<model>/<old>/``).

The manifest of the run gets a ``published`` entry (where, which version, which
models, from which folder): ``python -m pipeline deploy k8s`` points at it.
Two publishes of one prefix from different machines must not overlap (S3 has
no multi-object transaction).

**Ownership.** A model name under a prefix belongs to the recipe whose version of it is live
(the ``recipe`` of its live version's record). Publishing or rolling back a model that another
recipe published, or one whose live config has no record (``pipeline publish`` did not write it),
is refused before anything is uploaded (exit 2), as a local ``build`` refuses another recipe's
model folder: two recipes sharing a prefix need different ``triton.model_name`` values.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pipeline.errors import EnvironmentFault, GateFailed, PipelineError, RepositoryCorrupt
from pipeline.faults import fault_point
from pipeline.run.report import FAILED_DIR

CONFIG = "config.pbtxt"
RECORD = "trt-pipeline-version.json"
SERVE_DIR = "serve_repository"  # pipeline.serve.prepare.SERVE_DIR
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/prefix``; ``endpoint`` ("http://host:port") when the URL named one."""

    bucket: str
    prefix: str  # without leading or trailing "/"; "" = the bucket root
    endpoint: str | None = None

    @classmethod
    def parse(cls, url: str, option: str = "--to") -> "S3Location":
        """Parse ``s3://bucket/prefix``, ``s3://host:port/bucket/prefix`` or
        ``s3://https://host:port/bucket/prefix`` (Triton's forms); ``option`` names the
        command-line option in errors.

        Raises:
            PipelineError: not an s3:// URL, no bucket, or an invalid bucket name.
        """
        if not url.startswith("s3://"):
            raise PipelineError(f"{option} {url!r}: expected s3://bucket/prefix (or Triton's s3://host:port/bucket/prefix)")
        rest, scheme = url[len("s3://"):], None
        for s in ("http", "https"):
            if rest.startswith(f"{s}://"):
                scheme, rest = s, rest[len(s) + 3:]
        parts = [p for p in rest.split("/") if p]
        endpoint = None
        if parts and (scheme or ":" in parts[0]):
            endpoint = f"{scheme or 'http'}://{parts.pop(0)}"
        if not parts:
            raise PipelineError(f"{option} {url!r}: no bucket; expected s3://bucket/prefix")
        if not _BUCKET.match(parts[0]):
            raise PipelineError(f"{option} {url!r}: {parts[0]!r} is not a valid S3 bucket name "
                                "(3-63 characters: lower-case letters, digits, '.', '-')")
        return cls(parts[0], "/".join(parts[1:]), endpoint)

    @property
    def url(self) -> str:
        """``s3://bucket/prefix``: the form boto3, the AWS CLI and KServe's storageUri take."""
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def effective_endpoint(self) -> str | None:
        """The endpoint URL in use: the URL's own, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``."""
        return self.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None

    @property
    def triton_url(self) -> str:
        """What ``tritonserver --model-repository`` takes: ``s3://host:port/bucket/prefix``
        (``s3://https://host:port/...`` for TLS) with a custom endpoint, else :attr:`url`."""
        endpoint = self.effective_endpoint()
        if not endpoint:
            return self.url
        parts = urlsplit(endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        scheme = "https://" if parts.scheme == "https" else ""
        return f"s3://{scheme}{parts.hostname}:{port}/{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, *parts: str) -> str:
        """Object key of ``prefix/part/part...``."""
        return "/".join(p for p in (self.prefix, *parts) if p)


def s3_client(loc: S3Location, *, connect_timeout_s: float = 60.0, read_timeout_s: float = 60.0,
              attempts: int = 6) -> Any:
    """A boto3 S3 client with the standard AWS configuration (``loc.endpoint`` wins
    over ``AWS_ENDPOINT_URL``). ``attempts``: per call, the first included; the defaults are
    botocore's timeouts with 5 retries (``publish``, which must get through); the shared stage
    cache asks for less (:mod:`pipeline.remote.cache`).

    Raises:
        EnvironmentFault: boto3 cannot build a client (bad profile, bad region).
    """
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    try:
        return boto3.session.Session().client(
            "s3", endpoint_url=loc.endpoint,
            config=Config(connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                          retries={"total_max_attempts": attempts, "mode": "standard"}))
    except BotoCoreError as e:
        raise EnvironmentFault(f"{loc.url}: cannot configure an S3 client ({e}); check AWS_PROFILE, "
                               "AWS_DEFAULT_REGION and AWS_ENDPOINT_URL") from e


@contextlib.contextmanager
def storage_errors(loc: S3Location, doing: str) -> Iterator[None]:
    """Turn boto3 / botocore errors into EnvironmentFault (exit 4) naming ``loc`` and ``doing``."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        hint = f"; create the bucket first (aws s3 mb s3://{loc.bucket})" if code == "NoSuchBucket" else ""
        raise EnvironmentFault(f"{loc.url}: {doing} failed: {code or e}{hint} "
                               f"(endpoint {loc.effective_endpoint() or 'AWS'})") from e
    except BotoCoreError as e:
        raise EnvironmentFault(f"{loc.url}: {doing} failed: {e} (endpoint {loc.effective_endpoint() or 'AWS'})") from e


# --- objects -----------------------------------------------------------------------------------------


def upload_object(client: Any, bucket: str, path: Path, key: str, sha256: str) -> None:
    """Upload one file (multipart above 8 MiB) with its sha256 as ``x-amz-meta-sha256``."""
    client.upload_file(str(path), bucket, key, ExtraArgs={"Metadata": {"sha256": sha256}})


def put_bytes(client: Any, bucket: str, key: str, data: bytes) -> None:
    """Put a small object with its sha256 as metadata."""
    client.put_object(Bucket=bucket, Key=key, Body=data, Metadata={"sha256": hashlib.sha256(data).hexdigest()})


def read_object(client: Any, bucket: str, key: str) -> bytes | None:
    """The object's bytes, or None when there is no such key."""
    from botocore.exceptions import ClientError

    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise


def object_problem(client: Any, bucket: str, key: str, sha256: str) -> str | None:
    """Download ``key`` and hash it: None when its bytes and its ``sha256`` metadata both
    equal ``sha256``, else what differs."""
    from botocore.exceptions import ClientError

    try:
        obj = client.get_object(Bucket=bucket, Key=key)
    except ClientError as e:
        return f"s3://{bucket}/{key}: cannot be read back ({e.response.get('Error', {}).get('Code', e)})"
    h = hashlib.sha256()
    for chunk in iter(lambda: obj["Body"].read(1 << 22), b""):
        h.update(chunk)
    if h.hexdigest() != sha256:
        return f"s3://{bucket}/{key}: sha256 {h.hexdigest()[:12]} differs from the local file's {sha256[:12]}"
    meta = obj.get("Metadata", {}).get("sha256")
    if meta != sha256:
        return f"s3://{bucket}/{key}: metadata sha256 {str(meta)[:12]} differs from {sha256[:12]}"
    return None


def remote_versions(client: Any, loc: S3Location, model: str) -> list[int]:
    """Numeric version folders under ``prefix/model/`` (complete or not), ascending."""
    found = set()
    for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=loc.bucket, Prefix=loc.key(model) + "/", Delimiter="/"):
        for p in page.get("CommonPrefixes", []):
            name = p["Prefix"].rstrip("/").rsplit("/", 1)[-1]
            if name.isdigit():
                found.add(int(name))
    return sorted(found)


def live_version(client: Any, loc: S3Location, model: str) -> int | None:
    """The version ``prefix/model/config.pbtxt`` makes live, or None when there is no config.

    Raises:
        RepositoryCorrupt: the config has no ``version_policy.specific`` version.
    """
    from pipeline.triton.config import parse_config

    text = read_object(client, loc.bucket, loc.key(model, CONFIG))
    if text is None:
        return None
    versions = parse_config(text.decode()).version_policy.specific.versions
    if not versions:
        raise RepositoryCorrupt(f"{loc.url}/{model}/{CONFIG}: no version_policy.specific version; it was not "
                                "written by `pipeline publish` (publish again to take the prefix over)")
    return max(versions)


def version_record(client: Any, loc: S3Location, model: str, version: int) -> dict | None:
    """The completion record of ``model`` version ``version``, or None (incomplete or absent)."""
    data = read_object(client, loc.bucket, loc.key(model, str(version), RECORD))
    return None if data is None else json.loads(data)


def remote_owners(client: Any, loc: S3Location, live: dict[str, int | None]) -> dict[str, str | None]:
    """model -> the recipe that published what ``loc`` serves of it, for each model of ``live``
    (model -> its live version) that has a live config: the ``recipe`` of its live version's
    record; None when that version has no record (a config ``pipeline publish`` did not write).
    A record without a recipe name (``publish_version`` called without one) is left out."""
    owners: dict[str, str | None] = {}
    for model, version in live.items():
        if version is None:
            continue
        record = version_record(client, loc, model, version)
        if record is None:
            owners[model] = None
        elif isinstance(record, dict) and record.get("recipe"):
            owners[model] = str(record["recipe"])
    return owners


def check_remote_ownership(client: Any, loc: S3Location, recipe_name: str, live: dict[str, int | None],
                           fields: dict[str, str] | None = None) -> None:
    """Refuse to publish (or roll back) a model name whose live version under ``loc`` another
    recipe published, as the local repository refuses another recipe's model folder
    (:func:`pipeline.triton.publish.check_ownership`); reads only, writes nothing.

    Raises:
        ModelOwnedElsewhere: exit 2; one line per taken name (the model, its owner, the
            recipe field that names it), then the ways on.
    """
    from pipeline.triton.publish import ModelOwnedElsewhere

    if not recipe_name:
        return
    taken = {m: o for m, o in remote_owners(client, loc, live).items() if o != recipe_name}
    if not taken:
        return
    fields = fields or {}
    lines = [f"model {m!r} ({loc.url}/{m}) " + (f"is live at version {live[m]} published by recipe {o!r}" if o else
                                                 f"has a live {CONFIG} (version {live[m]}) with no {RECORD}: "
                                                 "`pipeline publish` did not write it")
             + (f"; it is this recipe's {fields[m]}" if m in fields else "") for m, o in taken.items()]
    raise ModelOwnedElsewhere(
        f"{loc.url}: recipe {recipe_name!r} would replace live models that are not its own; nothing was "
        "uploaded:\n  " + "\n  ".join(lines) + "\n"
        "Publish to another prefix (--to), give this recipe's model another name (triton.model_name, or "
        "triton.generate_model_name for the generation model), or, if that model should go, delete "
        f"{loc.url}/<model>/ first (no pipeline command removes models another recipe published)")


# --- local models ------------------------------------------------------------------------------------


@dataclass
class LocalModel:
    """One model folder of a verified local repository."""

    name: str
    version_dir: Path
    config_text: str
    files: dict[str, str]  # path relative to version_dir -> sha256


def local_model(repo: Path, name: str) -> LocalModel:
    """``repo/name``: its config.pbtxt and its one numeric version folder.

    Raises:
        PipelineError: the folder has no config.pbtxt, not exactly one version
            folder, or other entries (they would be shared by every published version).
    """
    from pipeline.triton.publish import tree_hashes

    folder = repo / name
    entries = sorted(p.name for p in folder.iterdir())
    versions = [e for e in entries if e.isdigit() and (folder / e).is_dir()]
    others = [e for e in entries if e not in versions and e != CONFIG]
    if not (folder / CONFIG).is_file() or len(versions) != 1 or others:
        raise PipelineError(f"{folder}: expected config.pbtxt and one numeric version folder; found {entries}")
    vdir = folder / versions[0]
    return LocalModel(name, vdir, (folder / CONFIG).read_text(), tree_hashes(vdir))


def versioned_config(config_text: str, version: int, pinned: Sequence[str]) -> str:
    """``config_text`` with ``version_policy { specific { versions: [version] } }`` and every
    ensemble step on a model in ``pinned`` set to ``model_version: version``."""
    from tritonclient.grpc import model_config_pb2 as mc

    from pipeline.triton.config import parse_config, to_text

    cfg = parse_config(config_text)
    cfg.version_policy.CopyFrom(mc.ModelVersionPolicy(specific=mc.ModelVersionPolicy.Specific(versions=[version])))
    for step in cfg.ensemble_scheduling.step:
        if step.model_name in pinned:
            step.model_version = version
    return to_text(cfg)


def commit_order(models: Sequence[str], front: Sequence[str]) -> list[str]:
    """``models`` with the ``front`` ones (generation model, ensemble) last."""
    return [m for m in models if m not in front] + [m for m in models if m in front]


# --- publish / rollback ------------------------------------------------------------------------------


def publish_version(repo: Path, models: Sequence[str], loc: S3Location, *, front: Sequence[str] = (),
                    client: Any = None, recipe_name: str = "", fields: dict[str, str] | None = None) -> dict:
    """Upload ``models`` of the verified local ``repo`` as version N+1 under ``loc``,
    re-hash every object, then make N+1 live (see the module docstring).

    Returns:
        ``{"version": N+1, "previous": N or None, "models": [...], "objects": int, "bytes": int}``.

    Raises:
        PipelineError: a local model folder is not publishable (see :func:`local_model`).
        ModelOwnedElsewhere: another recipe's version of a model is live under ``loc``
            (:func:`check_remote_ownership`; ``fields``: model -> the recipe field naming it).
        EnvironmentFault: a storage or network error, or an uploaded object that
            does not hash back to its file; the live version is unchanged unless
            the failure came while making the new version live (then the message says so).
    """
    local = [local_model(repo, m) for m in models]
    client = client or s3_client(loc)
    with storage_errors(loc, "listing versions"):
        live = {m.name: live_version(client, loc, m.name) for m in local}
        check_remote_ownership(client, loc, recipe_name, live, fields)
        highest = max([0, *(v for m in local for v in remote_versions(client, loc, m.name)),
                       *(v for v in live.values() if v)])
    version = highest + 1
    previous = max((v for v in live.values() if v), default=None)
    count, size = 0, 0
    with storage_errors(loc, f"uploading version {version} (the live version {previous} is unchanged)"):
        for m in local:
            for rel, sha in m.files.items():
                upload_object(client, loc.bucket, m.version_dir / rel, loc.key(m.name, str(version), rel), sha)
                count, size = count + 1, size + (m.version_dir / rel).stat().st_size
                fault_point(f"s3:upload:{count}")
        problems = [p for m in local for rel, sha in m.files.items()
                    if (p := object_problem(client, loc.bucket, loc.key(m.name, str(version), rel), sha))]
        if problems:
            raise EnvironmentFault(f"{loc.url}: version {version} did not upload intact; it is not live (the live "
                                   f"version {previous} is unchanged):\n  " + "\n  ".join(problems))
        configs = {}
        for m in local:
            configs[m.name] = versioned_config(m.config_text, version, models)
            record = {"version": version, "recipe": recipe_name, "files": m.files, "config": configs[m.name]}
            put_bytes(client, loc.bucket, loc.key(m.name, str(version), RECORD),
                      json.dumps(record, indent=2, sort_keys=True).encode())
        fault_point("s3:recorded")
    _make_live(client, loc, commit_order(models, front), version, configs)
    return {"version": version, "previous": previous, "models": list(models), "objects": count, "bytes": size}


def rollback_version(loc: S3Location, models: Sequence[str], *, front: Sequence[str] = (), client: Any = None,
                     recipe_name: str = "", fields: dict[str, str] | None = None) -> dict:
    """Make the highest complete version below the live one live again, after
    re-hashing its objects against its records.

    Returns:
        ``{"version": target, "previous": the live version, "models": [...], "objects": int}``.

    Raises:
        PipelineError: nothing is live under ``loc``, or no complete earlier version exists.
        ModelOwnedElsewhere: another recipe's version of a model is live (:func:`check_remote_ownership`).
        RepositoryCorrupt: an object of the target version differs from its record.
        EnvironmentFault: a storage or network error (the live version is unchanged).
    """
    client = client or s3_client(loc)
    with storage_errors(loc, "reading the live version"):
        live = {m: live_version(client, loc, m) for m in models}
        if not all(live.values()):
            raise PipelineError(f"{loc.url}: nothing to roll back: no live config.pbtxt for "
                                f"{[m for m, v in live.items() if not v]}")
        check_remote_ownership(client, loc, recipe_name, live, fields)
        current = max(v for v in live.values() if v)
        earlier = set.intersection(*({v for v in remote_versions(client, loc, m) if v < current} for m in models))
        records: dict[str, dict] = {}
        for version in sorted(earlier, reverse=True):
            found = {m: version_record(client, loc, m, version) for m in models}
            if all(found.values()):
                records = {m: r for m, r in found.items() if r}
                break
        if not records:
            raise PipelineError(f"{loc.url}: no complete version below the live version {current} for {list(models)}")
        problems = [p for m, r in records.items() for rel, sha in r["files"].items()
                    if (p := object_problem(client, loc.bucket, loc.key(m, str(version), rel), sha))]
    if problems:
        raise RepositoryCorrupt(f"{loc.url}: version {version} no longer matches its record; not rolled back "
                                f"(version {current} stays live):\n  " + "\n  ".join(problems))
    _make_live(client, loc, commit_order(models, front), version, {m: r["config"] for m, r in records.items()})
    return {"version": version, "previous": current, "models": list(models),
            "objects": sum(len(r["files"]) for r in records.values())}


def _make_live(client: Any, loc: S3Location, order: Sequence[str], version: int, configs: dict[str, str]) -> None:
    """Step 5: write each model's config.pbtxt, in ``order``."""
    with storage_errors(loc, f"making version {version} live (models before the failing one are live at "
                             f"{version}; publish again or --rollback)"):
        for i, name in enumerate(order):
            put_bytes(client, loc.bucket, loc.key(name, CONFIG), configs[name].encode())
            fault_point(f"s3:live:{i}")


# --- the command -------------------------------------------------------------------------------------


def passing_manifest(run_dir: Path) -> dict:
    """The recipe's last manifest, if its verdict is pass.

    Raises:
        GateFailed: no manifest (never built), or a verdict other than pass (the failed gates listed).
    """
    path = run_dir / "manifest.json"
    try:
        man = json.loads(path.read_text())
    except FileNotFoundError:
        raise GateFailed(f"{path}: missing; build the recipe first (its gates must pass before it is published)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise GateFailed(f"{path}: unreadable ({e}); build the recipe again") from None
    later = run_dir / FAILED_DIR / "manifest.json"
    if man.get("verdict") != "pass" or later.is_file():  # failed/: a later run did not pass (manifest.write_run_outputs)
        if later.is_file():
            path, man = later, json.loads(later.read_text())
        failed = [g.get("message", g.get("name", "?")) for g in man.get("gates", []) if not g.get("passed", True)]
        raise GateFailed(f"{path}: verdict {man.get('verdict')!r}, not 'pass': nothing is published"
                         + "".join(f"\n  {m}" for m in failed))
    return man


def front_models(recipe) -> list[str]:
    """The models clients call first (:meth:`ModelAdapter.front_model`): the LLM's generation
    model, an encoder's or image classifier's ensemble; none for a generic model."""
    from pipeline.models import registry

    front = registry.adapter(recipe.model).front_model(recipe)
    return [front] if front else []


def publish_recipe(recipe, loc: S3Location, *, serve_copy: bool = False, rollback: bool = False,
                   client: Any = None) -> dict:
    """Gate, then publish (or roll back) the recipe's models and record it in the manifest.

    Returns:
        The ``published`` entry added to ``<work_dir>/<recipe>/manifest.json``.

    Raises:
        GateFailed: the last run's verdict is not pass, or there was none.
        RepositoryCorrupt: the local folder fails verification.
        PipelineError: the folder holds none of the recipe's models, or the recipe (with its
            ``--set`` overrides) is not the one the last passing run built (exit 2).
        ModelOwnedElsewhere: ``loc`` serves another recipe's version of one of its model names (exit 2).
        LockHeld: a build of the recipe is running.
        EnvironmentFault: storage or network errors.
    """
    from pipeline.fsutil import write_json_atomic
    from pipeline.run.runner import run_lock
    from pipeline.stages.triton import model_names
    from pipeline.triton.publish import published_models, read_index, verify_repository

    run_dir = Path(recipe.work_dir) / recipe.name
    repo = run_dir / SERVE_DIR if serve_copy else Path(recipe.output_dir)
    with run_lock(run_dir):
        man = passing_manifest(run_dir)
        if man.get("recipe_hash") not in (None, recipe.digest):
            raise PipelineError(f"{run_dir / 'manifest.json'}: its passing run built recipe hash "
                                f"{man['recipe_hash'][:12]}, and this recipe (with its --set overrides) hashes "
                                f"{recipe.digest[:12]}: nothing published; valid: the overrides of that build, or "
                                "build with these first")
        models = published_models(repo, recipe.name)
        if not models:
            how = f"`python -m pipeline serve {recipe.name}` writes it" if serve_copy else "build the recipe"
            raise PipelineError(f"{repo}: holds no model of recipe {recipe.name!r} ({how})")
        problems = verify_repository(repo, models)
        if problems:
            raise RepositoryCorrupt(f"{repo}: fails verification, nothing published:\n  " + "\n  ".join(problems))
        models = commit_order(sorted(models), front_models(recipe))
        fields = model_names(recipe)
        if rollback:
            result = rollback_version(loc, models, front=front_models(recipe), client=client,
                                      recipe_name=recipe.name, fields=fields)
        else:
            result = publish_version(repo, models, loc, front=front_models(recipe), client=client,
                                     recipe_name=recipe.name, fields=fields)
        entry = {"action": "rollback" if rollback else "publish", "to": loc.url, "triton_url": loc.triton_url,
                 "endpoint": loc.effective_endpoint(), "source": str(repo),
                 "target": read_index(repo)[models[0]].get("target"),
                 "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **result}
        man["published"] = [*man.get("published", []), entry]
        write_json_atomic(run_dir / "manifest.json", man)
    return entry


def add_publish_arguments(parser: argparse.ArgumentParser) -> None:
    """``RECIPE --to URL [--serve-copy] [--rollback] [--set KEY=VALUE]``."""
    parser.add_argument("recipe", help="path to a recipe YAML, e.g. recipes/fp8-llm.yaml")
    parser.add_argument("--to", required=True, metavar="s3://BUCKET/PREFIX",
                        help="destination; endpoint from AWS_ENDPOINT_URL, or Triton's s3://host:port/bucket/prefix")
    parser.add_argument("--serve-copy", action="store_true",
                        help="publish the python-onnxruntime serve copy (artifacts/<recipe>/serve_repository) "
                             "for the pytriton wheel's server, instead of model_repository/ (stock container)")
    parser.add_argument("--rollback", action="store_true",
                        help="make the previous complete version live again (nothing is uploaded)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override, as for build (must match the build that is published)")


def cmd_publish(args: argparse.Namespace) -> int:
    """``python -m pipeline publish``; returns 0 (errors raise, see :func:`publish_recipe`)."""
    from pipeline.recipe.load import load_from_args

    loc = S3Location.parse(args.to)
    entry = publish_recipe(load_from_args(args), loc, serve_copy=args.serve_copy, rollback=args.rollback)
    what = "rolled back to" if args.rollback else "published"
    print(f"{what} version {entry['version']} of {', '.join(entry['models'])} at {loc.url} "
          f"(previous live version: {entry['previous']}); tritonserver --model-repository={loc.triton_url}")
    return 0
