"""Data sources (pipeline/datasets): every source type and format, hashing,
recipe-relative paths and the overlap rules (seconds, no model)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from pydantic import TypeAdapter, ValidationError

from conftest import ROOT
from pipeline.models import text as text_data
from pipeline.sources.data import DataError, DataSource, Labeled, Pair, check_disjoint, load
from pipeline.errors import EXIT_BAD_INPUT
from pipeline.recipe.load import load_recipe

DATA = ROOT / "tests" / "data" / "datasets"


def src(base=DATA, **spec) -> DataSource:
    return load(spec, base, where="validate.data")


# ---- built-in corpora -------------------------------------------------------------------

def test_corpus_gives_exactly_the_documents_of_load_documents():
    """The shipped recipes' validate split: the numbers of fp8-llm etc. cannot move."""
    docs = src(type="corpus", name="lee_background", split={"start": 220, "stop": 300}).items()
    text = (text_data.test_data_dir() / "lee_background.cor").read_text(encoding="utf-8")
    expected = [line.strip() for line in text.splitlines() if line.strip()][220:300]
    assert docs == expected == text_data.documents(load_recipe(ROOT / "recipes" / "fp8-llm.yaml").validate_.data)
    assert len(docs) == 80 and docs[0].startswith("The armed wing of the radical Islamic movement")


def test_corpus_word_sets_are_scored_pairs():
    pairs = src(type="corpus", name="wordsim353").items()
    assert len(pairs) == 353 and pairs[0] == Pair("love", "sex", 6.77)
    simlex = src(type="corpus", name="simlex999", split={"start": 1, "stop": 3})
    assert simlex.items() == [Pair("smart", "intelligent", 9.2), Pair("hard", "difficult", 8.77)]
    assert simlex.record_kind == "pairs"
    words, scores = text_data.word_pairs("simlex999")
    assert len(words) == 999 and words[1] == ("smart", "intelligent") and scores.dtype == np.float64


def test_corpus_range_past_the_end_and_unknown_name():
    with pytest.raises(DataError, match=r"validate.data.split: split \[250, 301\) reaches past the 300 documents "
                                        r"of lee_background.cor; valid: stop <= 300") as e:
        src(type="corpus", name="lee_background", split={"start": 250, "stop": 301}).items()
    assert e.value.exit_code == EXIT_BAD_INPUT
    with pytest.raises(DataError, match=r"validate.data.corpus.name: Input should be 'lee_background'"):
        src(type="corpus", name="imagenet")


# ---- text -------------------------------------------------------------------------------

def test_text_documents_are_non_blank_lines_in_range():
    s = src(type="text", path="news.txt", split={"start": 1})
    assert s.items() == ["The second one is about dogs.", "A third about birds.", "A fourth about fish."]
    assert s.record_kind == "documents" and s.files() == [DATA / "news.txt"]
    assert s.describe() == "text file news.txt, documents [1, end)"


def test_text_bad_file_missing_and_not_utf8(tmp_path):
    with pytest.raises(DataError, match=rf"validate.data.path: file {tmp_path}/nope.txt not found"):
        src(tmp_path, type="text", path="nope.txt").items()
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt is not UTF-8 text \(byte 3\)"):
        src(tmp_path, type="text", path="latin1.txt").items()


def test_text_empty_range():
    with pytest.raises(DataError, match=r"split \[4, end\) of .*news.txt is empty \(4 documents\); valid: start < 4"):
        src(type="text", path="news.txt", split={"start": 4}).items()
    with pytest.raises(DataError, match=r"validate.data.text.split: Value error, stop \(2\) must be greater"):
        src(type="text", path="news.txt", split={"start": 2, "stop": 2})


# ---- jsonl ------------------------------------------------------------------------------

def test_jsonl_texts_and_labels():
    plain = src(type="jsonl", path="reviews.jsonl", field="text", split={"start": 1, "stop": 3})
    assert plain.items() == ["Screen cracked within a week.", "Does the job, nothing more."]
    labeled = src(type="jsonl", path="reviews.jsonl", field="text", label_field="stars")
    assert labeled.record_kind == "labeled_documents"
    assert [tuple(x) for x in labeled.items()] == [("Great little phone, battery lasts two days.", 5),
                                                   ("Screen cracked within a week.", 1),
                                                   ("Does the job, nothing more.", 3), ("Would buy again.", 4)]


def test_jsonl_bad_line_names_the_line():
    with pytest.raises(DataError, match=r"reviews_bad_json.jsonl line 2: not JSON \(Expecting ',' delimiter"):
        src(type="jsonl", path="reviews_bad_json.jsonl", field="text").items()
    # the bad line is outside the range: not read
    assert src(type="jsonl", path="reviews_bad_json.jsonl", field="text", split={"stop": 1}).items() == ["Fine."]


def test_jsonl_missing_field_names_the_line_and_the_fields():
    with pytest.raises(DataError, match=r"validate.data.field: .*reviews_no_field.jsonl line 2: the record has no "
                                        r"field 'text' \(its fields: \['body', 'stars'\]\)"):
        src(type="jsonl", path="reviews_no_field.jsonl", field="text").items()
    with pytest.raises(DataError, match=r"validate.data.label_field: .*reviews.jsonl line 1: the record has no "
                                        r"field 'label'"):
        src(type="jsonl", path="reviews.jsonl", field="text", label_field="label").items()


# ---- pairs ------------------------------------------------------------------------------

def test_pairs_csv_by_column_name():
    s = src(type="pairs", path="sts.csv", text_a="sentence1", text_b="sentence2", score="score",
            split={"start": 1, "stop": 3})
    assert s.items() == [Pair("A woman, smiling, slices onions.", "A woman is cutting an onion.", 4.2),
                         Pair("A dog runs in the park.", "The stock market fell today.", 0.1)]
    assert s.record_kind == "pairs"


def test_pairs_tsv_by_index_without_header_keeps_bare_quotes():
    pairs = src(type="pairs", path="sts_noheader.tsv", header=False).items()
    assert [p.score for p in pairs] == [5.0, 3.5, 0.2]
    assert pairs[1].text_a == 'A "quoted" word here.'


def test_pairs_missing_column_bad_score_and_unknown_extension(tmp_path):
    with pytest.raises(DataError, match=r"validate.data.score: column 'gold' is not in the header of .*sts.csv; "
                                        r"valid: one of \['id', 'sentence1', 'sentence2', 'score'\]"):
        src(type="pairs", path="sts.csv", text_a="sentence1", text_b="sentence2", score="gold").items()
    with pytest.raises(DataError, match=r"sts_bad_score.csv line 3: score 'n/a' is not a finite number"):
        src(type="pairs", path="sts_bad_score.csv").items()
    with pytest.raises(DataError, match=r"sts_noheader.tsv line 1 has 3 columns, no column 5"):
        src(type="pairs", path="sts_noheader.tsv", header=False, score=5).items()
    shutil.copy(DATA / "sts.csv", tmp_path / "sts.dat")
    with pytest.raises(DataError, match=r"validate.data.delimiter: cannot tell the delimiter of .*sts.dat"):
        src(tmp_path, type="pairs", path="sts.dat").items()
    assert len(src(tmp_path, type="pairs", path="sts.dat", delimiter=",", text_a=1, text_b=2, score=3).items()) == 4


def test_pairs_schema_refuses_names_without_header():
    with pytest.raises(DataError, match="columns given by name need header: true"):
        src(type="pairs", path="sts.csv", header=False, text_a="sentence1")


# ---- images -----------------------------------------------------------------------------

def _image(path, color, fmt):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 3), color).save(path, fmt)


@pytest.fixture
def image_dir(tmp_path):
    root = tmp_path / "images"
    _image(root / "dog" / "b.png", (0, 0, 255), "PNG")
    _image(root / "cat" / "2.jpg", (0, 255, 0), "JPEG")
    _image(root / "cat" / "1.png", (255, 0, 0), "PNG")
    (root / "cat" / ".DS_Store").write_bytes(b"\0")
    return root


def test_images_labels_are_sorted_subfolders(image_dir):
    s = src(image_dir.parent, type="images", path="images")
    assert s.classes() == ["cat", "dog"] and s.record_kind == "images"
    assert s.items() == [Labeled(image_dir / "cat" / "1.png", 0), Labeled(image_dir / "cat" / "2.jpg", 0),
                         Labeled(image_dir / "dog" / "b.png", 1)]
    assert src(image_dir.parent, type="images", path="images", split={"start": 2}).items() == \
        [Labeled(image_dir / "dog" / "b.png", 1)]
    assert s.location() == image_dir and len(s.files()) == 3


def test_images_undecodable_file_and_bad_layout(image_dir):
    (image_dir / "dog" / "broken.png").write_bytes(b"not a png at all")
    s = src(image_dir.parent, type="images", path="images")
    with pytest.raises(DataError, match=r"validate.data.path: .*dog/broken.png cannot be decoded as an image"):
        s.items()
    (image_dir / "dog" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"dog/notes.txt is not an image file; valid extensions: .png, .jpg, .jpeg"):
        s.items()
    (image_dir.parent / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty has no subfolders; valid: one subfolder of images per label"):
        src(image_dir.parent, type="images", path="empty").items()
    _image(image_dir.parent / "flat" / "x.png", (1, 2, 3), "PNG")
    with pytest.raises(DataError, match=r"flat/x.png is not in a label subfolder; valid: .*flat/<label>/<image>"):
        src(image_dir.parent, type="images", path="flat").items()


# ---- npz --------------------------------------------------------------------------------

@pytest.fixture
def feeds(tmp_path):
    ids = np.arange(5 * 4, dtype=np.int64).reshape(5, 4)
    np.savez(tmp_path / "feeds.npz", input_ids=ids, attention_mask=np.ones_like(ids), labels=np.arange(5) % 2)
    return tmp_path / "feeds.npz", ids


def test_npz_feeds_and_labels(feeds):
    path, ids = feeds
    s = src(path.parent, type="npz", path="feeds.npz", labels="labels", split={"start": 1, "stop": 4})
    arrays, labels = s.arrays(["input_ids"])
    assert list(arrays) == ["input_ids"] and arrays["input_ids"].dtype == np.int64
    np.testing.assert_array_equal(arrays["input_ids"], ids[1:4])
    assert labels.tolist() == [1, 0, 1]
    items = s.items()
    assert len(items) == 3 and sorted(items[0].input) == ["attention_mask", "input_ids"]
    np.testing.assert_array_equal(items[0].input["input_ids"], ids[1]) and items[0].label == 1
    assert src(path.parent, type="npz", path="feeds.npz").items()[0].label is None


def test_npz_missing_input_labels_and_bad_file(feeds, tmp_path):
    path, _ = feeds
    s = src(path.parent, type="npz", path="feeds.npz", labels="labels")
    with pytest.raises(DataError, match=r"feeds.npz has no array for graph input 'pixel_values' \(arrays: "
                                        r"\['attention_mask', 'input_ids'\]\)"):
        s.items(["input_ids", "pixel_values"])
    with pytest.raises(DataError, match=r"validate.data.labels: .*feeds.npz has no array 'y'"):
        src(path.parent, type="npz", path="feeds.npz", labels="y").items()
    np.savez(tmp_path / "ragged.npz", a=np.zeros((3, 2)), b=np.zeros((4, 2)))
    with pytest.raises(DataError, match=r"arrays need the same first \(sample\) axis; got \{'a': 3, 'b': 4\}"):
        src(tmp_path, type="npz", path="ragged.npz").items()
    (tmp_path / "junk.npz").write_bytes(b"PK not really")
    with pytest.raises(DataError, match=r"junk.npz is not an .npz file"):
        src(tmp_path, type="npz", path="junk.npz").items()
    with pytest.raises(DataError, match=r"split \[0, 9\) reaches past the 5 samples"):
        src(path.parent, type="npz", path="feeds.npz", split={"stop": 9}).items()


# ---- hashing, relative paths ------------------------------------------------------------

def test_hash_is_the_file_sha256_and_follows_content(tmp_path):
    import hashlib

    f = tmp_path / "docs.txt"
    f.write_text("one\ntwo\n")
    s = src(tmp_path, type="text", path="docs.txt")
    assert s.sha256() == hashlib.sha256(b"one\ntwo\n").hexdigest()
    f.write_text("one\ntwo\nthree\n")
    assert s.sha256() == hashlib.sha256(b"one\ntwo\nthree\n").hexdigest()
    before = s.sha256()
    f.write_text("one\ntwo\nthreE\n")  # same size: the hash memo is keyed on mtime, as make is
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert s.sha256() not in (before, hashlib.sha256(b"one\ntwo\nthree\n").hexdigest())


def test_image_folder_hash_follows_content_and_labels(image_dir):
    s = src(image_dir.parent, type="images", path="images")
    first = s.sha256()
    (image_dir / "cat" / "1.png").rename(image_dir / "dog" / "1.png")  # same bytes, other label
    second = s.sha256()
    _image(image_dir / "dog" / "b.png", (9, 9, 9), "PNG")
    assert len({first, second, s.sha256()}) == 3


def test_relative_paths_resolve_against_the_recipe_folder(tmp_path, monkeypatch):
    recipe_dir = tmp_path / "recipes"
    (recipe_dir / "data").mkdir(parents=True)
    shutil.copy(DATA / "news.txt", recipe_dir / "data" / "news.txt")
    monkeypatch.chdir(tmp_path)  # not the recipe folder
    s = load({"type": "text", "path": "data/news.txt"}, recipe_dir)
    assert s.files() == [recipe_dir / "data" / "news.txt"] and len(s.items()) == 4
    # the recipe loader binds through pydantic's validation context
    bound = TypeAdapter(DataSource).validate_python({"type": "text", "path": "data/news.txt"},
                                                   context={"base_dir": recipe_dir})
    assert bound.items() == s.items()
    with pytest.raises(DataError, match=rf"file {tmp_path}/data/news.txt not found \(relative paths are read from "
                                        rf"the recipe's folder {tmp_path}\)"):
        load({"type": "text", "path": "data/news.txt"}, tmp_path).items()


def test_schema_is_strict_and_discriminated():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TypeAdapter(DataSource).validate_python({"type": "text", "path": "a.txt", "fields": "x"})
    with pytest.raises(DataError, match=r"validate.data: Input tag 'csv' found using 'type' does not match"):
        src(type="csv", path="a.csv")


def test_manifest_inputs_name_each_use():
    from pipeline import provenance

    uses = {"validate.data": src(type="text", path="news.txt")}
    out = provenance.inputs(uses.items())
    assert out == {"validate.data": {"path": str(DATA / "news.txt"), "sha256": uses["validate.data"].sha256()}}


def test_datasets_import_without_the_recipe():
    """recipe.py will import the source schema: the package must not import it back."""
    code = "import sys, pipeline.sources.data; assert 'pipeline.recipe.schema' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---- overlap ----------------------------------------------------------------------------

def test_same_corpus_overlapping_ranges_are_refused():
    cal = src(type="corpus", name="lee_background", split={"start": 0, "stop": 221})
    val = src(type="corpus", name="lee_background", split={"start": 220, "stop": 300})
    with pytest.raises(DataError, match=r"quantize.calibration.data and validate.data overlap: both read "
                                        r".*lee_background.cor, documents \[0, 221\) and documents \[220, 300\)") as e:
        check_disjoint({"quantize.calibration.data": cal, "validate.data": val})
    assert e.value.exit_code == EXIT_BAD_INPUT
    ok = src(type="corpus", name="lee_background", split={"start": 0, "stop": 200})
    check_disjoint({"quantize.calibration.data": ok, "validate.data": val})


@pytest.mark.parametrize("spec", [
    {"type": "text", "path": "news.txt"},
    {"type": "jsonl", "path": "reviews.jsonl", "field": "text"},
    {"type": "pairs", "path": "sts.csv", "text_a": 1, "text_b": 2, "score": 3},
], ids=["text", "jsonl", "pairs"])
def test_same_file_overlapping_ranges_are_refused_for_each_type(spec):
    first = src(**spec, split={"start": 0, "stop": 2})
    second = src(**spec, split={"start": 1})
    with pytest.raises(DataError, match=r"tuning and eval overlap: both read .*, \w+s \[0, 2\) and \w+s \[1, end\)"):
        check_disjoint({"tuning": first, "eval": second})
    check_disjoint({"tuning": first, "eval": src(**spec, split={"start": 2})})


def test_npz_and_images_overlap(feeds, image_dir):
    path, _ = feeds
    a = src(path.parent, type="npz", path="feeds.npz", split={"stop": 3})
    with pytest.raises(DataError, match=r"cal and eval overlap: .*samples \[0, 3\) and samples \[2, end\)"):
        check_disjoint({"cal": a, "eval": src(path.parent, type="npz", path="feeds.npz", split={"start": 2})})
    imgs = {"cal": src(image_dir.parent, type="images", path="images", split={"stop": 2}),
            "eval": src(image_dir.parent, type="images", path="images", split={"start": 1})}
    with pytest.raises(DataError, match=r"cal and eval overlap: both read .*cat/2.jpg, all of it and all of it"):
        check_disjoint(imgs)
    check_disjoint({"cal": imgs["cal"], "eval": src(image_dir.parent, type="images", path="images",
                                                    split={"start": 2})})


def test_copies_with_identical_content_are_refused(tmp_path, image_dir):
    shutil.copy(DATA / "news.txt", tmp_path / "copy.txt")
    with pytest.raises(DataError, match=r"cal and eval overlap: .*news.txt \(text file news.txt, documents "
                                        r"\[0, 2\)\) and .*copy.txt .* are different files with identical content"):
        check_disjoint({"cal": src(type="text", path="news.txt", split={"stop": 2}),
                        "eval": src(tmp_path, type="text", path="copy.txt", split={"start": 2})})
    shutil.copy(image_dir / "dog" / "b.png", tmp_path / "b_copy.png")
    other = tmp_path / "other"
    (other / "dog").mkdir(parents=True)
    shutil.copy(image_dir / "dog" / "b.png", other / "dog" / "b_copy.png")
    with pytest.raises(DataError, match=r"identical content"):
        check_disjoint({"cal": src(tmp_path, type="images", path="images"),
                        "eval": src(tmp_path, type="images", path="other")})


def test_same_file_read_as_two_units_is_refused():
    with pytest.raises(DataError, match=r"a and b both read .*reviews.jsonl, as documents and as records"):
        check_disjoint({"a": src(type="text", path="reviews.jsonl", split={"stop": 1}),
                        "b": src(type="jsonl", path="reviews.jsonl", field="text", split={"start": 3})})


def test_manifest_hashes_each_data_use_of_a_shipped_recipe():
    from pipeline.fsutil import sha256_file
    from pipeline import provenance
    from pipeline.run.report import data_uses, input_sources
    from pipeline.recipe.load import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml")
    corpus = text_data.test_data_dir() / "lee_background.cor"
    entry = {"path": str(corpus), "sha256": sha256_file(corpus)}
    hashed = provenance.inputs(input_sources(recipe, ROOT / "recipes"))
    assert list(hashed) == ["model_file", "quantize.calibration.data", "quantize.tuning.data", "validate.data"]
    assert hashed["model_file"] == {"path": str(recipe.model.source.location()), "sha256": recipe.model.source.sha256()}
    assert {k: v for k, v in hashed.items() if k != "model_file"} == {
        "quantize.calibration.data": entry, "quantize.tuning.data": entry, "validate.data": entry}
    uses = data_uses(recipe, ROOT / "recipes")
    assert [u.describe() for u in uses.values()] == ["built-in corpus lee_background, documents [0, 200)",
                                                     "built-in corpus lee_background, documents [200, 220)",
                                                     "built-in corpus lee_background, documents [220, 300)"]
    check_disjoint(uses)


def test_an_empty_data_file_says_so_not_start_below_zero(tmp_path):
    (tmp_path / "e.txt").write_text("\n")
    src = load({"type": "text", "path": "e.txt"}, tmp_path, "validate.data")
    with pytest.raises(DataError, match=r"is empty \(0 documents\); valid: a .*e.txt with at least one document$"):
        src.items()


# ---- shared records, whatever file or source type they come through --------------

DOCS = ["The first document is about cats.", "The second one is about dogs.", "A third about birds.",
        "A fourth about fish.", "A fifth about horses.", "A sixth about cows."]


def write_jsonl(path, texts) -> None:
    import json

    path.write_text("".join(json.dumps({"text": t, "stars": 3}) + "\n" for t in texts))


def test_the_same_documents_through_another_file_type_or_a_case_changed_copy_are_refused(tmp_path):
    """Before, only ranges of one file and byte-identical copies were compared: these passed `check`."""
    (tmp_path / "cal.txt").write_text("\n".join(DOCS) + "\n")
    write_jsonl(tmp_path / "eval.jsonl", DOCS[4:] + DOCS[:2])  # 2 of the calibration documents, as JSONL
    (tmp_path / "lower.txt").write_text("\n".join("  " + d.lower().replace(" ", "   ") for d in DOCS[3:]) + "\n")
    cal = src(tmp_path, type="text", path="cal.txt", split={"stop": 4})
    cases = {
        "jsonl": (src(tmp_path, type="jsonl", path="eval.jsonl", field="text"), 2, "record 0 of "
                  "quantize.calibration.data and record 2 of validate.data: 'the first document is about cats.'"),
        "labeled jsonl": (src(tmp_path, type="jsonl", path="eval.jsonl", field="text", label_field="stars"), 2, None),
        "lower-cased copy": (src(tmp_path, type="text", path="lower.txt"), 1, "'a fourth about fish.'"),
    }
    for name, (val, count, example) in cases.items():
        with pytest.raises(DataError, match=rf"quantize.calibration.data and validate.data share {count} records?: "
                                            r"text file cal.txt, documents \[0, 4\) and .* hold the same texts "
                                            r"\(compared case-folded, whitespace collapsed\)") as e:
            check_disjoint({"quantize.calibration.data": cal, "validate.data": val})
        assert e.value.exit_code == EXIT_BAD_INPUT, name
        assert example is None or example in str(e.value), (name, str(e.value))
    # the records a use does not read are not shared
    check_disjoint({"quantize.calibration.data": src(tmp_path, type="text", path="cal.txt", split={"start": 2, "stop": 3}),
                    "validate.data": src(tmp_path, type="jsonl", path="eval.jsonl", field="text")})
    # one document in two ranges of one file: disjoint ranges, shared text
    (tmp_path / "dup.txt").write_text("\n".join([*DOCS, DOCS[0].upper()]) + "\n")
    with pytest.raises(DataError, match=r"tuning and eval share 1 record: .*record 0 of tuning and record 6 of eval"):
        check_disjoint({"tuning": src(tmp_path, type="text", path="dup.txt", split={"stop": 3}),
                        "eval": src(tmp_path, type="text", path="dup.txt", split={"start": 3})})


def test_sentence_pairs_are_compared_as_pairs_in_either_order(tmp_path):
    (tmp_path / "a.csv").write_text("a,b,score\nA cat sat.,A dog ran.,4\nRain fell.,Sun shone.,1\n")
    (tmp_path / "b.tsv").write_text("x\ty\ts\na dog ran.\ta cat sat.\t3\n")
    with pytest.raises(DataError, match=r"cal and eval share 1 record: .* hold the same sentence pairs"):
        check_disjoint({"cal": src(tmp_path, type="pairs", path="a.csv"), "eval": src(tmp_path, type="pairs", path="b.tsv")})


def test_check_refuses_calibration_documents_reached_through_a_jsonl_file(tmp_path, capsys):
    from pipeline.cli.app import main

    (tmp_path / "cal.txt").write_text("\n".join(DOCS) + "\n")
    write_jsonl(tmp_path / "eval.jsonl", [d.upper() for d in DOCS[3:]])
    recipe = str(ROOT / "recipes" / "fp8-encoder.yaml")
    sets = ["--set", f"quantize.calibration.data={{type: text, path: {tmp_path / 'cal.txt'}}}",
            "--set", f"validate.data={{type: jsonl, path: {tmp_path / 'eval.jsonl'}, field: text}}"]
    assert main(["check", recipe, *sets]) == 2
    err = capsys.readouterr().err
    assert "quantize.calibration.data and validate.data share 3 records: text file" in err and "eval.jsonl" in err


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")
                                        if "images" not in p.read_text()))
def test_the_shipped_recipes_data_uses_share_no_record(name):
    """lee_background holds 7 documents twice (104 and 112, ...): each pair within one split."""
    from pipeline.run.report import data_uses

    check_disjoint(data_uses(load_recipe(ROOT / "recipes" / f"{name}.yaml"), ROOT / "recipes"))


def test_jsonl_fields_of_feeds_are_compared_as_canonical_json(tmp_path):
    """A generic model's JSONL records hold objects of numeric rows, not texts: compared exactly."""
    import json

    rows = [{"x": [1, 2], "y": [3]}, {"x": [4, 5], "y": [6]}, {"x": [7, 8], "y": [9]}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"inputs": r}) + "\n" for r in rows))
    (tmp_path / "b.jsonl").write_text(json.dumps({"inputs": {"y": [9], "x": [7, 8]}}) + "\n")
    a = src(tmp_path, type="jsonl", path="a.jsonl", field="inputs", split={"stop": 2})
    with pytest.raises(DataError, match=r"cal and eval share 1 record: .*record 2 of cal and record 0 of eval"):
        check_disjoint({"cal": src(tmp_path, type="jsonl", path="a.jsonl", field="inputs"),
                        "eval": src(tmp_path, type="jsonl", path="b.jsonl", field="inputs")})
    check_disjoint({"cal": a, "eval": src(tmp_path, type="jsonl", path="b.jsonl", field="inputs")})
