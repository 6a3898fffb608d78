"""repository.json owns model names: a recipe may not publish over another recipe's model,
and a cached triton stage counts only while its models are still assigned to it.

The builds use a hand-made ONNX graph as an ``onnx:`` source (no torch export), so a
whole pipeline run into a shared model repository takes seconds."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from pipeline.cli import app as cli
from pipeline.errors import PipelineError
from pipeline.triton import publish
from pipeline.triton.publish import INDEX_FILE, JOURNAL_FILE, ModelOwnedElsewhere
from test_onnx_source import byte_graph, onnx_workspace


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``folder``."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def second_recipe(owner: Path, name: str) -> Path:
    """A copy of recipe ``owner`` named ``name``: same model name, same output_dir and work_dir."""
    data = yaml.safe_load(owner.read_text())
    data["name"] = name
    path = owner.parent / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def owner_built(tmp_path_factory) -> Path:
    """Recipe ``custom-model`` (model ``custom_int8``) built and published once."""
    tmp = tmp_path_factory.mktemp("owner")
    path = onnx_workspace(tmp, byte_graph())
    data = yaml.safe_load(path.read_text())
    data["name"] = "custom-model"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert cli.main(["build", str(path), "--quiet"]) == 0
    return path


def repo_of(path: Path) -> Path:
    return Path(yaml.safe_load(path.read_text())["output_dir"])


def staged(tmp_path: Path, name: str, text: str) -> tuple[Path, dict[str, dict]]:
    """A staging folder with one model folder ``name`` and its index entry for recipe ``b``."""
    staging = tmp_path / "staging"
    (staging / name).mkdir(parents=True)
    (staging / name / "config.pbtxt").write_text(text)
    return staging, {name: {"recipe": "b", "files": publish.tree_hashes(staging / name)}}


def test_publish_refuses_a_name_another_recipe_owns_and_writes_nothing(tmp_path):
    repo = tmp_path / "repo"
    staging, entries = staged(tmp_path, "m", "a's config")
    publish.publish(staging, repo, {"m": {**entries["m"], "recipe": "a"}}, "a")
    before = snapshot(repo)
    staging, entries = staged(tmp_path / "b", "m", "b's config")
    with pytest.raises(ModelOwnedElsewhere) as err:
        publish.publish(staging, repo, entries, "b")
    assert err.value.exit_code == 2
    msg = str(err.value)
    assert f"model 'm' ({repo / 'm'}) belongs to recipe 'a'" in msg and "recipe 'b'" in msg
    assert "triton.model_name" in msg and f"{repo / INDEX_FILE}" in msg and "nothing was published" in msg
    assert snapshot(repo) == before and not (repo / JOURNAL_FILE).exists()
    assert json.loads((repo / INDEX_FILE).read_text())["models"]["m"]["recipe"] == "a"


def test_foreign_owners_ignores_own_and_unindexed_names(tmp_path):
    repo = tmp_path / "repo"
    staging, entries = staged(tmp_path, "m", "x")
    publish.publish(staging, repo, {"m": {**entries["m"], "recipe": "a"}}, "a")
    assert publish.foreign_owners(repo, "a", ["m", "other"]) == {}
    assert publish.foreign_owners(repo, "b", ["m", "other"]) == {"m": "a"}
    assert publish.verify_repository(repo, ["m"], recipe="a") == []
    assert publish.verify_repository(repo, ["m"], recipe="b") == [
        f"{repo / 'm'}: {INDEX_FILE} assigns it to recipe 'a', not 'b'"]


def test_another_recipe_with_the_same_model_name_is_refused_exit_2(owner_built, capsys):
    repo = repo_of(owner_built)
    before = snapshot(repo)
    scratch = second_recipe(owner_built, "scratch")
    capsys.readouterr()
    assert cli.main(["build", str(scratch), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"model 'custom_int8' ({repo / 'custom_int8'}) belongs to recipe 'custom-model'" in err
    assert "it is this recipe's triton.model_name" in err and "recipe 'scratch'" in err
    assert snapshot(repo) == before  # folder bytes and repository.json untouched
    assert {k: v["recipe"] for k, v in publish.read_index(repo).items()} == {"custom_int8": "custom-model"}
    assert not any(p.name.startswith(f".{repo.name}.staging-scratch-") for p in repo.parent.iterdir())
    # refused at the pre-flight, before the first stage: no run folder at all
    assert not (Path(yaml.safe_load(scratch.read_text())["work_dir"]) / "scratch").exists()


def test_cached_triton_stage_is_a_miss_once_another_recipe_owns_its_model(owner_built, capsys):
    """The state an older version left (scratch took custom_int8 over): the owner's rebuild
    must not report 'triton: cached' over scratch's bytes; it is refused, naming scratch."""
    repo = repo_of(owner_built)
    assert cli.main(["build", str(owner_built)]) == 0  # still owned: a cache hit
    assert "triton: cached (ok)" in capsys.readouterr().err  # progress lines go to stderr
    onnx_file = repo / "custom_int8" / "1" / "model.onnx"
    onnx_file.write_bytes(onnx_file.read_bytes() + b"\0")  # scratch's bytes, recorded as scratch's
    index = json.loads((repo / INDEX_FILE).read_text())
    entry = index["models"]["custom_int8"]
    entry["recipe"], entry["files"]["1/model.onnx"] = "scratch", hashlib.sha256(onnx_file.read_bytes()).hexdigest()
    (repo / INDEX_FILE).write_text(json.dumps(index))
    assert publish.verify_repository(repo) == []  # consistent as scratch's repository
    code = cli.main(["build", str(owner_built)])
    err = capsys.readouterr().err
    assert code == 2 and "cached" not in err  # the pre-flight refuses before any stage
    assert "model 'custom_int8'" in err and "belongs to recipe 'scratch'" in err
    # Past the pre-flight (the Python API), the cached triton stage is a miss, then refused.
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    with pytest.raises(PipelineError, match="belongs to recipe 'scratch'"):
        run_pipeline(load_recipe(owner_built), owner_built)
    err = capsys.readouterr().err
    assert "triton: cached" not in err and "validate: cached (ok)" in err
    assert f"{INDEX_FILE} assigns it to recipe 'scratch', not 'custom-model'; republishing" in err  # cache-miss note


def test_check_names_free_names_the_recipe_field_of_each_taken_model(tmp_path):
    from conftest import ROOT
    from pipeline.recipe.load import load_recipe
    from pipeline.stages.triton import check_names_free, model_names

    repo = tmp_path / "repo"
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"output_dir": str(repo)})
    assert model_names(recipe) == {"smollm2_fp8": "triton.model_name", "smollm2_generate": "triton.generate_model_name"}
    check_names_free(recipe)  # no repository yet: nothing is taken
    staging, entries = staged(tmp_path, "smollm2_generate", "other's generation model")
    publish.publish(staging, repo, {"smollm2_generate": {**entries["smollm2_generate"], "recipe": "chat-bot"}},
                    "chat-bot")
    with pytest.raises(ModelOwnedElsewhere) as err:
        check_names_free(recipe)
    msg = str(err.value)
    assert "model 'smollm2_generate'" in msg and "belongs to recipe 'chat-bot'" in msg
    assert "it is this recipe's triton.generate_model_name" in msg and "'smollm2_fp8'" not in msg


def test_a_hand_made_folder_of_the_same_name_is_refused_before_any_stage(owner_built, capsys):
    repo = repo_of(owner_built)
    (repo / "handmade" / "1").mkdir(parents=True)
    (repo / "handmade" / "1" / "model.bin").write_text("precious")
    try:
        assert cli.main(["build", str(owner_built), "--quiet", "--set", "triton.model_name=handmade"]) == 2
        err = capsys.readouterr().err
        assert f"model 'handmade' ({repo / 'handmade'}) is a folder no recipe published (not in {INDEX_FILE})" in err
        assert (repo / "handmade" / "1" / "model.bin").read_text() == "precious"
        (repo / "handfile").write_text("a file of the model's name")
        assert cli.main(["build", str(owner_built), "--quiet", "--set", "triton.model_name=handfile"]) == 2
        assert "model 'handfile' " in capsys.readouterr().err and (repo / "handfile").is_file()
        assert cli.main(["verify-repo", str(repo)]) == 4  # the whole repository: an unlisted model folder
        assert f"{repo / 'handmade'}: a model folder not listed in {INDEX_FILE}" in capsys.readouterr().err
    finally:
        import shutil

        shutil.rmtree(repo / "handmade")
        (repo / "handfile").unlink(missing_ok=True)


@pytest.mark.parametrize("text, says", [
    ('{"models": ', "unreadable"),
    ("[]", 'its top level is not an object with a "models" object'),
    ('{"models": {"x": 5}}', "entry 'x' is not an object"),
    ('{"models": {"../victim": {"recipe": "a", "files": {}}}}', "entry '../victim' is not a model folder name"),
    ('{"models": {"m": {"recipe": "a", "files": null}}}', "entry 'm': \"files\" is not an object"),
    ('{"models": {"m": {"recipe": "a", "files": {"1/model.onnx": 5}}}}', "entry 'm': \"files\" is not an object"),
])
def test_a_corrupt_index_fails_verification_and_builds_exit_4_deleting_nothing(tmp_path, capsys, text, says):
    repo = tmp_path / "repo"
    staging, entries = staged(tmp_path, "m", "x")
    publish.publish(staging, repo, {"m": {**entries["m"], "recipe": "a"}}, "a")
    (tmp_path / "victim").mkdir()
    (repo / INDEX_FILE).write_text(text)
    before = snapshot(tmp_path)
    assert cli.main(["verify-repo", str(repo)]) == 4
    assert f"{repo / INDEX_FILE}: " in capsys.readouterr().err
    staging, entries = staged(tmp_path / "b", "n", "y")
    with pytest.raises(publish.RepositoryCorrupt, match=says) as err:
        publish.publish(staging, repo, {"n": {**entries["n"], "recipe": "a"}}, "a")
    assert err.value.exit_code == 4
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("b/")} == before


@pytest.mark.parametrize("journal", ["null", "[]", '{"recipe": "a"}', "VICTIM"])
def test_a_journal_no_publish_wrote_is_refused_and_nothing_is_done_on_its_word(tmp_path, capsys, journal):
    repo = tmp_path / "repo"
    staging, entries = staged(tmp_path, "m", "x")
    publish.publish(staging, repo, {"m": {**entries["m"], "recipe": "a"}}, "a")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    if journal == "VICTIM":  # well formed, but its staging folder is an unrelated one
        journal = json.dumps({"recipe": "a", "staging": str(victim), "models": {}, "stale": [], "index": {"models": {}}})
    (repo / JOURNAL_FILE).write_text(journal)
    before = snapshot(tmp_path)
    assert cli.main(["verify-repo", str(repo)]) == 4
    assert f"{repo / JOURNAL_FILE}: not a publish journal of {repo}" in capsys.readouterr().err
    staging, entries = staged(tmp_path / "b", "n", "y")
    with pytest.raises(publish.RepositoryCorrupt, match="nothing was done on its word"):
        publish.publish(staging, repo, {"n": {**entries["n"], "recipe": "a"}}, "a")
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("b/")} == before


def test_a_publish_removes_what_a_killed_write_left_in_the_repository(tmp_path):
    repo = tmp_path / "repo"
    staging, entries = staged(tmp_path, "m", "x")
    publish.publish(staging, repo, {"m": {**entries["m"], "recipe": "a"}}, "a")
    for left in (".repository.json.tmp-abc", "..publish-journal.json.tmp-def"):  # write_atomic's scratch
        (repo / left).write_text("half")
    staging, entries = staged(tmp_path / "b", "m", "y")
    publish.publish(staging, repo, {"m": {**entries["m"], "recipe": "a"}}, "a")
    assert sorted(p.name for p in repo.iterdir()) == [".publish.lock", "m", INDEX_FILE]



def test_verify_repo_writes_nothing_into_the_repository_it_checks(tmp_path, capsys):
    repo = tmp_path / "copied"
    staging, entries = staged(tmp_path, "m", "x")
    publish.publish(staging, tmp_path / "repo", {"m": {**entries["m"], "recipe": "a"}}, "a")
    import shutil

    shutil.copytree(tmp_path / "repo", repo, ignore=shutil.ignore_patterns(publish.LOCK_FILE))  # e.g. a synced copy
    assert cli.main(["verify-repo", str(repo)]) == 0
    assert sorted(p.name for p in repo.iterdir()) == ["m", INDEX_FILE]
