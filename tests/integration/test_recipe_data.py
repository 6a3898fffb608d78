"""Data sources in the recipe: `quantize.calibration.data` and
`validate.data` replace `dataset` + `split`, overlapping uses fail `check` and the
start of `build`, and a user's own JSONL eval set runs end to end on the tiny LM."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from pipeline.models import text as text_data
from pipeline.cli.app import main
from pipeline.sources.data import DataError, load
from pipeline.errors import RecipeError
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from tiny import seed_export, tiny_recipe

LLM = ROOT / "recipes" / "fp8-llm.yaml"


def _write(folder: Path, mutate, source: Path = LLM) -> str:
    recipe = yaml.safe_load(source.read_text())
    mutate(recipe)
    path = folder / source.name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def _lee(start: int, stop: int) -> list[str]:
    return text_data.documents(load_recipe(LLM, {"validate.data.split": {"start": start, "stop": stop}}).validate_.data)


# --- the older shape is refused with the new form -----------------------------------------------

@pytest.mark.parametrize(
    "section, at",
    [(("quantize", "calibration"), "quantize.calibration.dataset"), (("validate",), "validate.dataset")],
)
def test_dataset_and_split_are_refused_with_the_data_form(tmp_path, section, at):
    def old(d):
        node = d
        for k in section:
            node = node[k]
        node.pop("data")
        node.update(dataset="lee_background", split={"start": 220, "stop": 300})

    path = _write(tmp_path, old)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    line = next(i for i, t in enumerate(Path(path).read_text().splitlines(), 1) if t.strip().startswith("dataset:")
                and (section == ("validate",)) == (t.startswith("  dataset")))
    assert (f"{path}:{line}: {at}: dataset and split were replaced by a data source (types corpus, text, jsonl, "
            "pairs, images, npz); write data: {type: corpus, name: lee_background, split: {start: 220, stop: 300}}"
            ) in str(err.value)


@pytest.mark.parametrize("key, new", [("quantize.calibration.split", "quantize.calibration.data.split"),
                                      ("validate.split.stop", "validate.data.split.stop"),
                                      ("validate.dataset", "validate.data.name")])
def test_old_data_set_keys_name_the_new_key(key, new):
    with pytest.raises(RecipeError, match=rf"--set {key}: \w+ moved into the data source; set {new}$"):
        load_recipe(LLM, {key: 1})


# --- texts of a source ---------------------------------------------------------------------------------

def test_documents_of_each_text_source(tmp_path):
    (tmp_path / "news.txt").write_text("first doc\n\n  second doc \nthird\n")
    (tmp_path / "rev.jsonl").write_text('{"text": "good", "stars": 5}\n\n{"text": "bad", "stars": 1}\n')
    (tmp_path / "sts.csv").write_text("a,b,score\nx,y,1\n")

    def validate_data(spec):
        path = _write(tmp_path, lambda d: d["validate"].update(data=spec))
        return load_recipe(path).validate_.data

    assert text_data.documents(validate_data({"type": "text", "path": "news.txt", "split": {"start": 1}})) == [
        "second doc", "third"]
    assert text_data.documents(validate_data({"type": "jsonl", "path": "rev.jsonl", "field": "text"})) == ["good", "bad"]
    assert text_data.documents(validate_data({"type": "jsonl", "path": "rev.jsonl", "field": "text",
                                         "label_field": "stars"})) == ["good", "bad"]
    with pytest.raises(DataError, match=r"^validate.data.path: file .*missing.txt not found"):
        text_data.documents(validate_data({"type": "text", "path": "missing.txt"}))
    with pytest.raises(RecipeError, match=r"validate.data.type: sentence pairs sts.csv .*, rows \[0, end\) gives pairs; a text-generation "
                                        r"model reads texts here"):
        validate_data({"type": "pairs", "path": "sts.csv"})


def test_shipped_recipes_read_the_same_documents_as_before():
    """Same documents, same order: the shipped recipes' numbers cannot move."""
    text = (text_data.test_data_dir() / "lee_background.cor").read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for name in ("fp8-llm", "int8-encoder", "fp8-encoder"):
        r = load_recipe(ROOT / "recipes" / f"{name}.yaml")
        assert text_data.documents(r.quantize.calibration.data) == lines[0:200]
        assert text_data.documents(r.validate_.data) == lines[220:300]


# --- overlap at check time --------------------------------------------------------------------------------

def test_check_refuses_overlapping_corpus_ranges_naming_both_uses(tmp_path, capsys):
    path = _write(tmp_path, lambda d: d["validate"]["data"].update(split={"start": 150, "stop": 300}))
    assert main(["check", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    corpus = text_data.test_data_dir() / "lee_background.cor"
    assert err == [f"error: quantize.calibration.data and validate.data overlap: both read {corpus}, documents "
                   "[0, 200) and documents [150, 300); valid: disjoint document ranges"]


def test_an_overlap_a_set_made_names_the_set(tmp_path, capsys):
    path = _write(tmp_path, lambda d: None)
    assert main(["check", path, "--set", "validate.data.split.start=150"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: quantize.calibration.data and validate.data overlap: ")
    assert err.endswith("valid: disjoint document ranges [from --set validate.data.split.start]")


def test_check_refuses_a_copy_of_the_calibration_file_as_eval_data(tmp_path, capsys):
    (tmp_path / "cal.txt").write_text("\n".join(_lee(0, 40)))
    (tmp_path / "eval.txt").write_text("\n".join(_lee(0, 40)))
    path = _write(tmp_path, lambda d: (d["quantize"]["calibration"].update(data={"type": "text", "path": "cal.txt"}),
                                       d["validate"].update(data={"type": "text", "path": "eval.txt"})))
    assert main(["check", path]) == 2
    err = capsys.readouterr().err
    assert (f"error: quantize.calibration.data and validate.data overlap: {tmp_path / 'cal.txt'} (text file "
            in err and f"and {tmp_path / 'eval.txt'} (text file " in err and "are different files with identical "
            "content" in err)


def test_check_names_a_missing_data_file(tmp_path, capsys):
    path = _write(tmp_path, lambda d: d["validate"].update(data={"type": "jsonl", "path": "eval.jsonl",
                                                                 "field": "text"}))
    assert main(["check", path]) == 2
    assert f"error: validate.data.path: file {tmp_path / 'eval.jsonl'} not found" in capsys.readouterr().err


def test_build_refuses_overlap_before_any_stage(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("pipeline.run.runner.run_pipeline", lambda *a, **k: pytest.fail("no stage may run"))
    path = _write(tmp_path, lambda d: d["quantize"]["calibration"]["data"].update(split={"start": 221, "stop": 230}))
    assert main(["build", path]) == 2
    assert "quantize.calibration.data and validate.data overlap" in capsys.readouterr().err


# --- a user's JSONL eval set, end to end on the tiny LM ------------------------------------------------------

def _jsonl(path: Path, docs: list[str]) -> None:
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))


def test_user_jsonl_validate_source_end_to_end(tmp_path, tiny_model, tiny_export):
    """The same documents read from the built-in corpus and from a user's JSONL give the
    same metrics; editing the JSONL in place re-measures, and the manifest hashes it."""
    corpus_ws, user_ws = tmp_path / "corpus", tmp_path / "user"
    corpus_ws.mkdir(), user_ws.mkdir()
    corpus_path = tiny_recipe(corpus_ws, tiny_model)
    seed_export(corpus_ws, tiny_export)
    corpus = run_pipeline(load_recipe(corpus_path), corpus_path, quiet=True)

    _jsonl(user_ws / "eval.jsonl", _lee(220, 300))
    user_path = tiny_recipe(user_ws, tiny_model, **{"validate.data": {"type": "jsonl", "path": "eval.jsonl",
                                                                      "field": "text"}})
    seed_export(user_ws, tiny_export)
    assert main(["check", str(user_path)]) == 0
    user = run_pipeline(load_recipe(user_path), user_path, quiet=True)
    assert user.passed and corpus.passed
    keys = ("perplexity_fp32", "perplexity_fp8", "relative_perplexity_increase", "token_agreement", "eval_windows")
    assert {k: user.manifest["metrics"][k] for k in keys} == {k: corpus.manifest["metrics"][k] for k in keys}
    entry = user.manifest["inputs"]["validate.data"]
    assert entry["path"] == str(user_ws / "eval.jsonl")
    assert entry["sha256"] == load({"type": "jsonl", "path": "eval.jsonl", "field": "text"}, user_ws).sha256()
    [gate] = user.manifest["gates"]
    assert gate["name"] == "max_relative_perplexity_increase" and gate["passed"]

    _jsonl(user_ws / "eval.jsonl", _lee(230, 300))  # edited in place: other windows
    edited = run_pipeline(load_recipe(user_path), user_path, quiet=True)
    assert edited.manifest["stages"]["validate"]["cache_hit"] is False
    assert edited.manifest["inputs"]["validate.data"]["sha256"] != entry["sha256"]
    assert edited.manifest["metrics"]["perplexity_fp32"] != user.manifest["metrics"]["perplexity_fp32"]
