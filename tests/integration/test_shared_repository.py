"""The repository where users really put it: shared by two recipes built at
once, on a mounted volume, on a full or read-only disk.

Builds use the hand-made ONNX graph of the custom-model example (``onnx:`` source, no
torch export), so a whole run takes seconds. Latency and errnos are injected with
the fault shim (:mod:`pipeline.faults`)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from pipeline.cli import app as cli
from pipeline.errors import STORAGE_ERRNOS, GateFailed, StorageFault, storage_fault
from pipeline.remote.s3 import passing_manifest
from pipeline.triton import publish
from pipeline.triton.publish import INDEX_FILE, JOURNAL_FILE, verify_repository
from test_onnx_source import byte_graph, onnx_workspace
from test_repository_ownership import snapshot

ERRNOS = sorted(errno.errorcode[e] for e in STORAGE_ERRNOS)


def renamed(path: Path, name: str, model: str) -> Path:
    """A copy of recipe ``path`` named ``name`` serving model ``model``, same output_dir."""
    data = yaml.safe_load(path.read_text())
    data["name"], data["triton"]["model_name"] = name, model
    new = path.parent / f"{name}.yaml"
    new.write_text(yaml.safe_dump(data, sort_keys=False))
    return new


def build_proc(path: Path, env: dict, *sets: str) -> subprocess.Popen:
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.Popen([sys.executable, "-m", "pipeline", "build", str(path), "--quiet", *args], cwd=ROOT,
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return onnx_workspace(tmp_path_factory.mktemp("shared"), byte_graph())


def test_two_recipes_publishing_at_once_with_slow_writes_both_end_up_published(workspace):
    """Two real processes, 1 s added at every publish step (as on a network file system):
    both publishes overlap in time, the lock serialises them, and both models are indexed."""
    a, b = renamed(workspace, "recipe-a", "model_a"), renamed(workspace, "recipe-b", "model_b")
    repo = Path(yaml.safe_load(a.read_text())["output_dir"])
    slow = {"PIPELINE_FAULT_DELAY_S": "1.0", "PIPELINE_FAULT_DELAY_AT": "publish:"}
    procs = [build_proc(p, slow) for p in (a, b)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    index = publish.read_index(repo)
    assert {k: v["recipe"] for k, v in index.items()} == {"model_a": "recipe-a", "model_b": "recipe-b"}
    assert verify_repository(repo) == [] and cli.main(["verify-repo", str(repo)]) == 0
    assert not (repo / JOURNAL_FILE).exists()
    assert not [p for d in (repo, repo.parent) for p in d.iterdir() if ".staging-" in p.name]


def test_staging_beside_the_repository_when_its_folder_shares_the_device(tmp_path):
    repo = tmp_path / "models"
    assert publish.staging_parent(repo) == tmp_path
    link = tmp_path / "link"
    link.symlink_to(repo)
    staging = publish.new_staging(link, "r")  # resolved: beside the real folder, named after it
    assert staging.parent == tmp_path and staging.name.startswith(".models.staging-r-")


def _mount_tmpfs(target: Path) -> str | None:
    """Mount a small tmpfs at ``target``; the reason when this machine cannot."""
    if shutil.which("mount") is None:
        return "no mount command"
    target.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(target)],
                          capture_output=True, text=True)
    return None if proc.returncode == 0 else f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}"


@pytest.fixture
def mounted_repo(tmp_path):
    """A repository that is itself a mount point (as a PVC at /models), reached through a symlink."""
    target = tmp_path / "volume"
    why = _mount_tmpfs(target)
    if why:
        pytest.skip(why)
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False)


def test_repository_on_a_mounted_volume_stages_inside_it_and_publishes(tmp_path, mounted_repo):
    assert os.stat(mounted_repo).st_dev != os.stat(tmp_path).st_dev
    assert publish.staging_parent(mounted_repo) == mounted_repo
    link = tmp_path / "models"
    link.symlink_to(mounted_repo)
    path = onnx_workspace(tmp_path, byte_graph())
    data = yaml.safe_load(path.read_text())
    data["output_dir"] = str(link)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert cli.main(["build", str(path), "--quiet"]) == 0
    assert verify_repository(link) == [] and "custom_int8" in publish.read_index(link)
    assert sorted(p.name for p in mounted_repo.iterdir()) == [".publish.lock", "custom_int8", INDEX_FILE]


def test_storage_fault_names_folder_free_and_needed_space(tmp_path):
    err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x" / "model.onnx"))
    wrapped = RuntimeError("export failed")
    wrapped.__cause__ = err
    fault = storage_fault(wrapped, needed_bytes=3 * 2**20)
    assert isinstance(fault, StorageFault) and fault.exit_code == 4
    msg = str(fault)
    assert msg.startswith(f"{tmp_path / 'x'}: no space left on the device") and "needs 3.0 MiB" in msg
    assert "MiB free there" in msg and "model.onnx" in msg
    assert storage_fault(OSError(errno.EACCES, "denied")) is None


def _published(tmp_path: Path) -> tuple[Path, Path, dict]:
    path = onnx_workspace(tmp_path, byte_graph())
    assert cli.main(["build", str(path), "--quiet"]) == 0
    repo = Path(yaml.safe_load(path.read_text())["output_dir"])
    return path, repo, snapshot(repo)


#: write sites of a publish: a staged model file, the journal, the swap of the first model, the index
SITES = ["copy:model.onnx", f"write:{JOURNAL_FILE}", "publish:model:0", f"write:{INDEX_FILE}"]


@pytest.mark.parametrize("code", ERRNOS)
def test_each_storage_errno_at_each_publish_write_site_exits_4_and_keeps_the_repository(tmp_path, code, capsys,
                                                                                       monkeypatch):
    path, repo, before = _published(tmp_path)
    monkeypatch.setenv("PIPELINE_FAULT_ERRNO", code)
    for i, site in enumerate(SITES):
        monkeypatch.setenv("PIPELINE_FAULT", site)
        capsys.readouterr()
        rc = cli.main(["build", str(path), "--quiet",
                       "--set", f"triton.dynamic_batching.max_queue_delay_microseconds={200 + i}"])
        err = capsys.readouterr().err
        assert rc == 4, (site, err)
        assert f"[Errno {getattr(errno, code)}]" in err and str(repo) in err, (site, err)
        assert "internal error" not in err, site
        assert snapshot(repo) == before and verify_repository(repo) == [], site
        assert not [p for d in (repo, repo.parent) for p in d.iterdir() if ".staging-" in p.name], site


def test_full_disk_during_export_exits_4(tmp_path, capsys, monkeypatch):
    """The export stage's first atomic write (its graph check report or the graph) fails."""
    path = onnx_workspace(tmp_path, byte_graph())
    monkeypatch.setenv("PIPELINE_FAULT_ERRNO", "ENOSPC")
    monkeypatch.setenv("PIPELINE_FAULT", "write:model.onnx")
    rc = cli.main(["build", str(path), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 4 and "no space left on the device" in err and "[Errno 28]" in err, err
    assert "internal error" not in err


def test_full_disk_with_no_file_named_names_the_stages_folder(tmp_path, capsys, monkeypatch):
    """torch's exporter raises ENOSPC naming no file (seen on a 150 KiB tmpfs: "export: torch.onnx.export
    failed: OSError: [Errno 28]"), and the message said "a write: no space left": it names the stage and
    its folder now. The injected error names no file either."""
    path = onnx_workspace(tmp_path, byte_graph())
    monkeypatch.setenv("PIPELINE_FAULT_ERRNO", "ENOSPC")
    monkeypatch.setenv("PIPELINE_FAULT", "stage:export:start")
    rc = cli.main(["build", str(path), "--quiet"])
    err = capsys.readouterr().err
    folder = tmp_path / "artifacts" / "onnx-source" / "export"
    assert rc == 4 and f"error: stage export: {folder}: no space left on the device ([Errno 28]" in err, err
    assert "a write" not in err and "MiB free there" in err
    record = json.loads((tmp_path / "artifacts" / "onnx-source" / "manifest.json").read_text())
    assert record["stages"]["export"]["status"] == "failed" and str(folder) in record["stages"]["export"]["reason"]


def test_out_of_memory_in_a_stage_exits_4_naming_the_stage_and_memory(tmp_path, capsys, monkeypatch):
    """An allocation failure (here ENOMEM at the quantize stage's start) is exit 4, not a bug's 3:
    the message names the stage, its peak resident memory, this machine's memory and what the
    stage holds; the manifest records the failed stage."""
    path = onnx_workspace(tmp_path, byte_graph())
    monkeypatch.setenv("PIPELINE_FAULT_ERRNO", "ENOMEM")
    monkeypatch.setenv("PIPELINE_FAULT", "stage:quantize:start")
    rc = cli.main(["build", str(path), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 4 and "internal error" not in err, err
    assert "error: stage quantize: out of memory (OSError: [Errno 12]" in err, err
    assert "peak resident memory" in err and "GiB available now" in err and "calibration" in err, err
    record = json.loads((tmp_path / "artifacts" / "onnx-source" / "manifest.json").read_text())
    assert record["stages"]["quantize"]["status"] == "failed" and "MemoryFault: stage quantize: out of memory" in record["stages"]["quantize"]["reason"]


def test_allocation_failures_are_memory_faults_and_other_errors_are_not():
    from pipeline.memory import memory_fault

    ort_like = RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while "
                            "running MatMul node. Name:'m' Status Message: std::bad_alloc")
    wrapped = ValueError("validate failed")
    wrapped.__cause__ = MemoryError()
    for exc in (MemoryError(), ort_like, wrapped, OSError(errno.ENOMEM, "Cannot allocate memory")):
        fault = memory_fault(exc, "validate", 1234.0)
        assert fault is not None and fault.exit_code == 4, exc
        assert str(fault).startswith("stage validate: out of memory (") and "1,234 MiB" in str(fault)
    assert memory_fault(RuntimeError("shape mismatch")) is None
    assert memory_fault(OSError(errno.ENOSPC, "full")) is None
    assert memory_fault(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is not None
    assert memory_fault(ValueError("memory layout of 'x' is not contiguous")) is None
    try:  # `raise ... from None` ends the chain: a recipe error raised while handling one is not an OOM
        try:
            raise MemoryError()
        except MemoryError:
            raise ValueError("quantize.tuning: no window") from None
    except ValueError as e:
        assert memory_fault(e) is None


def test_errors_with_their_own_exit_code_keep_it_whatever_they_say():
    """The runner turns an allocation failure into exit 4, but not a gate (1), bad input (2) or an
    environment error (4) of ours whose message happens to name memory."""
    from pipeline.errors import GateFailed, InternalError, RecipeError
    from pipeline.run.runner import _memory_fault

    for exc in (GateFailed("plan: not enough memory for the KV cache"), RecipeError("out of memory hint")):
        assert _memory_fault(exc, "validate", 1.0) is None
    internal = InternalError("onnxruntime failed: std::bad_alloc")
    assert _memory_fault(internal, "validate", 1.0).exit_code == 4


def test_a_refused_run_keeps_the_published_record_and_serve_names_the_gate(tmp_path, capsys):
    """A passing build, then ``serve`` of the recipe with a gate it cannot pass: exit 1 with the
    failed gate's row and what model_repository/ still holds (repository.json's recipe hash and
    time); manifest.json and report.md stay the passing run's, the refused run's go to failed/."""
    path = onnx_workspace(tmp_path, byte_graph())
    assert cli.main(["build", str(path), "--quiet"]) == 0
    run_dir, repo = tmp_path / "artifacts" / "onnx-source", tmp_path / "model_repository"
    passed = json.loads((run_dir / "manifest.json").read_text())
    kept = {n: (run_dir / n).read_bytes() for n in ("manifest.json", "report.md", "junit.xml")}
    index = publish.read_index(repo)
    entry = index[sorted(index)[0]]
    assert entry["recipe_hash"] == passed["recipe_hash"] and entry["published_at"].endswith("+00:00")
    capsys.readouterr()

    assert cli.main(["serve", str(path), "--quiet", "--set", "validate.gates.0.min=1.5"]) == 1
    err = capsys.readouterr().err
    [gate] = [g for g in json.loads((run_dir / "failed" / "manifest.json").read_text())["gates"] if not g["passed"]]
    assert f"  {gate['message']}" in err.splitlines() and "FAILED: mean_cosine = " in gate["message"]
    assert "bound >= 1.5" in gate["message"] and f"{run_dir / 'failed' / 'report.md'}" in err
    assert (f"{repo}/ still holds recipe onnx-source's last verified publish: {', '.join(sorted(index))} "
            f"(recipe hash {entry['recipe_hash'][:12]}, published {entry['published_at']})") in err
    assert {n: (run_dir / n).read_bytes() for n in kept} == kept  # the published run's record is untouched
    assert (run_dir / "failed" / "report.md").read_text().startswith("# onnx-source: FAIL")
    with pytest.raises(GateFailed, match="failed/manifest.json: verdict 'fail'"):
        passing_manifest(run_dir)  # publish to S3 still refuses: the latest run did not pass

    assert cli.main(["build", str(path), "--quiet"]) == 0  # passing again: the stale failed/ record goes
    assert not (run_dir / "failed").exists() and passing_manifest(run_dir)["verdict"] == "pass"


def test_describe_publish_reads_the_record_and_says_when_files_no_longer_verify(tmp_path):
    staging, repo = tmp_path / "staging", tmp_path / "repo"
    (staging / "m" / "1").mkdir(parents=True)
    (staging / "m" / "1" / "model.onnx").write_bytes(b"weights")
    publish.publish(staging, repo, {"m": {"recipe": "r", "recipe_hash": "ab" * 32,
                                          "files": publish.tree_hashes(staging / "m")}}, "r")
    when = publish.read_index(repo)["m"]["published_at"]
    assert publish.describe_publish(repo, "r") == (
        f"{repo}/ still holds recipe r's last verified publish: m (recipe hash {'ab' * 6}, published {when})")
    (repo / "m" / "1" / "model.onnx").write_bytes(b"changed")
    assert "recipe r's last publish, which FAILS verification (" in publish.describe_publish(repo, "r")
    assert publish.describe_publish(repo, "other") == f"{repo}/ holds no model of recipe other"
