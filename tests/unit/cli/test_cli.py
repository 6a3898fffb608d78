"""CLI exit codes, --set values (§3) and verify-repo, driven in-process."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from pipeline.cli import app as cli
from pipeline.cli.app import main
from pipeline.recipe.load import parse_set_value
from pipeline.errors import GateFailed, LockHeld

RECIPE = str(ROOT / "recipes" / "fp8-llm.yaml")


def recipe_in(tmp_path) -> str:
    """fp8-llm with work_dir / output_dir under ``tmp_path``."""
    data = yaml.safe_load(open(RECIPE).read())
    data["work_dir"], data["output_dir"] = str(tmp_path / "artifacts"), str(tmp_path / "repo")
    path = tmp_path / "fp8-llm.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "text, value",
    [
        ("*mlp*", "*mlp*"),
        ("[*mlp*]", ["*mlp*"]),
        ('["*mlp*"]', ["*mlp*"]),
        ("[*mlp*, 'a b', \"c\"]", ["*mlp*", "a b", "c"]),
        ("[1, 8]", [1, 8]),
        ("0.5", 0.5),
        ("{min: 1, max: 2}", {"min": 1, "max": 2}),
        ("a: 1\na: 2", "a: 1\na: 2"),  # duplicate keys: not taken as a mapping
    ],
)
def test_set_value_is_yaml_else_plain_string(text, value):
    assert parse_set_value(text) == value


def test_check_valid_recipe_exits_0(capsys):
    code, out, err = run(capsys, "check", RECIPE)
    assert code == 0 and "valid recipe 'fp8-llm'" in out and err == ""


@pytest.mark.parametrize("value", ["[*mlp*]", '["*mlp*"]'])
def test_glob_list_override_is_accepted(capsys, value):
    assert run(capsys, "check", RECIPE, f"--set=quantize.exclude.nodes={value}")[0] == 0


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--set=quantize.exclude.nodes=*mlp*"], "quantize.exclude.nodes: Input should be a valid list (got '*mlp*') "
                                                 "[from --set quantize.exclude.nodes]"),
        (["--set=build.profiles.2.dims.batch.max=16"], "error: --set build.profiles.2.dims.batch.max: build.profiles "
                                                       "is a list of 1 item(s)"),
        (["--set", "nothing"], "error: --set 'nothing': expected KEY=VALUE"),
        (["--set=triton.max_batch_size=64"], "triton.max_batch_size: 64 is greater than the max batch 8"),
    ],
)
def test_bad_input_exits_2_with_one_error_and_no_traceback(capsys, args, expect):
    code, out, err = run(capsys, "check", RECIPE, *args)
    assert code == 2 and expect in err and "Traceback" not in out + err and err.startswith("error: ")


def test_missing_recipe_and_usage_errors_exit_2(capsys, tmp_path):
    assert run(capsys, "check", str(tmp_path / "nope.yaml"))[0] == 2
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys, "verify-repo", "x", "--set", "a=1")[0] == 2  # verify-repo takes no --set


def _fake_run(exc):
    def run_pipeline(*args, **kwargs):
        raise exc
    return run_pipeline


@pytest.mark.parametrize("exc, code", [(GateFailed("gate"), 1), (LockHeld("held by pid 1"), 4),
                                       (KeyboardInterrupt(), 130)])
def test_exit_codes_of_build(capsys, monkeypatch, tmp_path, exc, code):
    monkeypatch.setattr("pipeline.run.runner.run_pipeline", _fake_run(exc))
    got, out, err = run(capsys, "build", recipe_in(tmp_path))
    assert got == code and "Traceback" not in out + err


def test_internal_error_saves_traceback_next_to_the_recipe(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("pipeline.run.runner.run_pipeline", _fake_run(ZeroDivisionError("division by zero")))
    code, out, err = run(capsys, "build", recipe_in(tmp_path))
    log = tmp_path / "artifacts" / "fp8-llm" / "error.log"
    assert code == 3 and "Traceback" not in out + err
    assert err.strip().count("\n") == 0
    assert err.startswith("internal error: ZeroDivisionError: division by zero") and str(log) in err
    assert "Traceback (most recent call last)" in log.read_text() and "ZeroDivisionError" in log.read_text()


def test_internal_error_before_the_recipe_is_read_goes_to_the_cwd(capsys, monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'x'")
    monkeypatch.setattr("pipeline.recipe.load.load_recipe", broken)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "check", RECIPE)
    assert code == 3 and str(cli.FALLBACK_LOG) in err and "Traceback" not in out + err
    assert "AttributeError" in (tmp_path / "pipeline-error.log").read_text()


def test_verify_repo(capsys, tmp_path):
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    files = {"config.pbtxt": b'name: "m"\n', "1/model.onnx": b"onnx bytes"}
    for rel, data in files.items():
        (repo / "m" / rel).write_bytes(data)
    index = {"models": {"m": {"recipe": "r", "files": {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}}}}
    (repo / "repository.json").write_text(json.dumps(index))
    code, out, err = run(capsys, "verify-repo", str(repo))
    assert code == 0 and out.strip() == f"verified: {repo} (1 models)"
    (repo / "m" / "1" / "model.onnx").write_bytes(b"changed")
    (repo / "m" / "extra.txt").write_text("x")
    code, out, err = run(capsys, "verify-repo", str(repo))
    assert code == 4 and "2 problem(s)" in err
    assert f"{repo / 'm' / '1' / 'model.onnx'}: sha256" in err and "extra.txt: not part of the published model" in err


def test_verify_repo_skips_the_bytecode_caches_a_server_writes_and_checks_other_pyc(capsys, tmp_path):
    """The python backend's stub writes <version>/__pycache__/model.cpython-3XY.pyc into a repository
    served in place, and verify-repo (so publish) exited 4 on it."""
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    files = {"config.pbtxt": b'name: "m"\n', "1/model.py": b"x = 1\n"}
    for rel, data in files.items():
        (repo / "m" / rel).write_bytes(data)
    index = {"models": {"m": {"recipe": "r", "files": {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}}}}
    (repo / "repository.json").write_text(json.dumps(index))
    (repo / "m" / "1" / "__pycache__").mkdir()
    for tag in ("cpython-311", "cpython-312.opt-1"):  # this Python's and a container's
        (repo / "m" / "1" / "__pycache__" / f"model.{tag}.pyc").write_bytes(b"bytecode")
    code, out, err = run(capsys, "verify-repo", str(repo))
    assert code == 0 and out.strip() == f"verified: {repo} (1 models)", err
    (repo / "m" / "1" / "model.pyc").write_bytes(b"importable on its own")
    (repo / "m" / "1" / "__pycache__" / "notes.txt").write_text("x")
    code, out, err = run(capsys, "verify-repo", str(repo))
    assert code == 4 and "2 problem(s)" in err and "model.pyc: not part of the published model" in err
    assert "__pycache__/notes.txt: not part of the published model" in err


@pytest.mark.parametrize("target", ["serve", "bench"])
def test_make_serve_and_bench_pass_args_through(target):
    import shutil
    import sys

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    args = "--set serve.concurrency=[1,8] --no-aiperf" if target == "bench" else "--check --openai-port 0"
    done = make_n(target, "RECIPE=int8-llm", f"ARGS={args}", f"VENV={sys.prefix}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"{sys.prefix}/bin/python -m pipeline {target} recipes/int8-llm.yaml {args}"


def make_n(*args: str):
    """``make -n ARGS`` in the repository, as a top-level make: under ``make test`` it would be a
    sub-make, inheriting the parent's flags and printing "Entering directory" lines."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env)


def test_make_with_an_unknown_recipe_names_the_recipes():
    import shutil
    import sys

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = make_n("build", "RECIPE=nope", f"VENV={sys.prefix}")
    names = " ".join(sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")))
    assert done.returncode == 2 and not done.stdout
    assert f"recipes/nope.yaml not found; RECIPE is one of: {names} (a recipe elsewhere: " in done.stderr
    as_path = make_n("build", "RECIPE=recipes/fp8-llm.yaml", f"VENV={sys.prefix}")
    assert as_path.returncode == 2 and "(a name, not a path: RECIPE=fp8-llm)" in as_path.stderr
    elsewhere = make_n("build", "RECIPE=/elsewhere/fp8-llm.yaml", f"VENV={sys.prefix}")  # another file
    assert elsewhere.returncode == 2 and "a name, not a path" not in elsewhere.stderr


@pytest.mark.parametrize("aiperf, greedy, code", [({"levels": []}, [], 0), ({"failed": "aiperf exited with status 1"}, [], 4),
                                                   ({"failed": "aiperf exited with status 1"}, [{"x": 1}], 1)])
def test_bench_exit_code_says_what_failed(capsys, monkeypatch, aiperf, greedy, code):
    from pipeline.cli import app as cli
    from pipeline.serve import run

    served = type("Served", (), {"run_dir": Path("run")})()
    monkeypatch.setattr(cli, "_served", lambda args: served)
    monkeypatch.setattr(run, "bench", lambda *a, **k: {"llm": {"aiperf": aiperf}, "markdown": "table"})
    monkeypatch.setattr(run, "failures", lambda result: [f"prompt {g['x']}" for g in greedy])
    assert main(["bench", str(ROOT / "recipes" / "fp8-llm.yaml")]) == code
    if code == 4:
        assert "bench: aiperf exited with status 1 (--no-aiperf skips AIPerf)" in capsys.readouterr().err


def test_help_is_plain_text(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out
    assert "Command line: python -m pipeline build recipes/fp8-llm.yaml." in out


def test_usage_names_the_command_the_user_typed(monkeypatch):
    from pipeline.cli.app import build_parser

    monkeypatch.setattr(sys, "argv", ["/venv/bin/trtpipe", "--help"])
    assert build_parser().format_usage().startswith("usage: trtpipe ")
    assert build_parser().description == "Command line: trtpipe build recipes/fp8-llm.yaml."
    monkeypatch.setattr(sys, "argv", ["/repo/pipeline/__main__.py", "--help"])
    assert build_parser().format_usage().startswith("usage: python -m pipeline ")


def test_the_cli_turns_library_tqdm_bars_off_unless_the_user_set_it(tmp_path, monkeypatch, capsys):
    import subprocess

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert main(["check", str(tmp_path / "missing.yaml")]) == 2
    assert os.environ["TQDM_DISABLE"] == "1"
    bar = [sys.executable, "-c", "from tqdm.auto import tqdm; list(tqdm(range(3), desc='Loading weights'))"]
    assert subprocess.run(bar, capture_output=True, text=True, check=True).stderr == ""  # what a library's bar does then
    monkeypatch.setenv("TQDM_DISABLE", "")  # the user's own setting wins: bars shown
    assert main(["check", str(tmp_path / "missing.yaml")]) == 2
    assert "Loading weights" in subprocess.run(bar, capture_output=True, text=True, check=True).stderr


@pytest.mark.parametrize("code", [0, 1])
def test_sys_exit_in_a_model_entry_is_an_error_naming_the_entry_never_its_code(tmp_path, capsys, code, monkeypatch):
    import shutil

    project = tmp_path / "p"
    shutil.copytree(ROOT / "examples" / "custom-model", project)
    (project / "model.py").write_text(f"import sys\n\n\ndef make_model():\n    sys.exit({code})\n")
    monkeypatch.chdir(project)
    assert main(["build", "recipe.yaml"]) == 2
    err = capsys.readouterr().err
    assert f"model.source.entry: ./model.py:make_model called sys.exit({code})" in err


def test_sys_exit_deeper_inside_a_command_is_an_internal_error(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "cmd_check", lambda args: sys.exit(0))
    monkeypatch.setattr(cli, "preflight", lambda args: sys.exit(0))
    assert main(["check", str(ROOT / "recipes" / "fp8-llm.yaml")]) == 3
    assert "internal error: RuntimeError: sys.exit(0) was called inside the command" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["work_dir", "output_dir"])
def test_an_output_folder_that_cannot_be_written_fails_the_preflight_naming_its_key(tmp_path, capsys, key):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    recipe = str(ROOT / "recipes" / "int8-encoder.yaml")
    assert main(["check", recipe, "--set", f"{key}={blocker / 'sub'}"]) == 2
    assert f"error: {key}: {blocker / 'sub'} cannot be written ({blocker} is a file, not a folder)" in capsys.readouterr().err
    assert main(["check", recipe, "--set", f"{key}=/proc/no-such-folder"]) == 2
    assert f"error: {key}: /proc/no-such-folder cannot be written (" in capsys.readouterr().err
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert main(["check", recipe, "--set", f"{key}={tmp_path / 'dangling' / 'x'}"]) == 2
    assert f"{tmp_path / 'dangling'} is a symlink to a missing {tmp_path / 'gone'}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "dangling"]  # the probe leaves nothing


def test_a_recipe_folder_whose_name_is_not_utf8_is_bad_input_not_a_crash(tmp_path, capsys):
    import shutil

    folder = os.fsdecode(os.fsencode(tmp_path) + b"/p\xff")  # the byte 0xff decodes to a lone surrogate
    shutil.copytree(ROOT / "examples" / "custom-model", folder)
    assert main(["check", os.path.join(folder, "recipe.yaml")]) == 2
    assert f"error: {tmp_path}/p\\xff/recipe.yaml: the path is not UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["artifacts/int8-encoder/export", "artifacts", "."])
def test_an_output_dir_that_overlaps_the_run_folder_is_refused(tmp_path, capsys, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(ROOT / "recipes" / "int8-encoder.yaml"), "--set", f"output_dir={where}"]) == 2
    assert f"error: output_dir: {where} overlaps the run folder {tmp_path / 'artifacts' / 'int8-encoder'}" in (
        capsys.readouterr().err)
