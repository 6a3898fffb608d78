"""Export faults in user models: each one is a small torch module,
exported with ``export_checks.export_module`` (torch.onnx.export(dynamo=True) with named
Dims, as the stage's adapters do) and verified with ``export_checks.verify_export``."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from pipeline.checks import export as ec
from pipeline.errors import ExportError

AXES = {"x": {0: "batch"}}


class Flatten(torch.nn.Module):
    """``x [batch, 4, 8] -> [batch, 3]``; ``fixed`` flattens with a constant batch of 2."""

    def __init__(self, fixed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.fixed, self.lin = fixed, torch.nn.Linear(32, 3)

    def forward(self, x):
        return self.lin(x.reshape(2, 32) if self.fixed else x.flatten(1))


class PerSample(torch.nn.Module):
    """The same map, but one row at a time in a Python loop."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(32, 3)

    def forward(self, x):
        return torch.stack([self.lin(x[i].flatten()) for i in range(x.shape[0])])


class Attention(torch.nn.Module):
    """One-head self-attention over ``x [batch, seq, 8]`` with a bool key mask ``[batch, seq]``.

    ``mode``: ``"float"`` is SDPA with an additive ``-inf`` mask (torch gives 0
    for a fully masked row, the exported graph NaN); ``"bool"`` is SDPA with
    the bool mask (torch 0, the graph the mean of the masked keys);
    ``"fill"`` is masked_fill(-inf) + softmax (NaN in both).
    """

    def __init__(self, mode: str):
        super().__init__()
        torch.manual_seed(0)
        self.mode, self.q = mode, torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        q = self.q(x)[:, None]
        keys = mask[:, None, None, :]
        if self.mode == "fill":
            scores = (q @ q.transpose(-1, -2)).masked_fill(~keys, float("-inf"))
            return (scores.softmax(-1) @ q)[:, 0]
        if self.mode == "float":
            keys = torch.zeros(keys.shape, dtype=q.dtype).masked_fill(~keys, float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=keys)[:, 0]


def _x(batch: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal((batch, 4, 8)).astype(np.float32)}


def _attn_feeds() -> dict[str, np.ndarray]:
    mask = np.ones((2, 5), bool)
    mask[1, 3:] = False
    return {"x": np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32), "mask": mask}


ATTN_AXES = {"x": {0: "batch", 1: "sequence"}, "mask": {0: "batch", 1: "sequence"}}


def _export_verify(module, feeds, axes, tmp_path):
    path = tmp_path / "model.onnx"
    ec.export_module(module.eval(), feeds, axes, path, output_names=["y"])
    return ec.verify_export(module, feeds, path, axes)


def test_vectorised_module_passes_every_probe(tmp_path):
    reports = _export_verify(Flatten(fixed=False), _x(2), AXES, tmp_path)
    assert [r["dims"] for r in reports] == [{"batch": 3}, {"batch": 4}]
    assert all(r["passed"] for r in reports)


def test_constant_reshape_is_named(tmp_path):
    with pytest.raises(ExportError) as e:
        _export_verify(Flatten(fixed=True), _x(2), AXES, tmp_path)
    msg = str(e.value)
    assert "input 'x' axis 0 (batch)" in msg and "Reshape node" in msg and "[2, 32]" in msg
    assert "x.flatten(1)" in msg and e.value.exit_code == 2


def test_flattening_reshape_into_the_inferred_dim_is_not_a_baked_dim():
    """GPT-2's Conv1D: [batch, sequence, 64] -> [-1, 64] keeps 64 as the last axis and folds
    batch and sequence into the -1; a [batch, 32] -> [2, -1] still bakes the batch."""
    def graph(data_shape, target):
        node = helper.make_node("Reshape", ["x", "shape"], ["y"], name="r")
        shape = helper.make_tensor("shape", TensorProto.INT64, [len(target)], target)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, data_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])

    axes = {"x": {0: "batch", 1: "sequence"}}
    assert ec.baked_reshapes(graph(["batch", "sequence", 64], [-1, 64]), axes) == []
    found = ec.baked_reshapes(graph(["batch", 32], [2, -1]), {"x": {0: "batch"}})
    assert [(str(a), n, t) for a, n, t in found] == [("input 'x' axis 0 (batch)", "r", [2, -1])]


def test_per_sample_loop_is_named(tmp_path):
    with pytest.raises(ExportError) as e:
        _export_verify(PerSample(), _x(2), AXES, tmp_path)
    msg = str(e.value)
    assert "input 'x' axis 0 (batch)" in msg and "per-sample loop was unrolled into 2 copies" in msg
    assert "vectorise" in msg


def test_batch_one_example_is_refused_before_export(tmp_path):
    with pytest.raises(ExportError) as e:
        ec.export_module(Flatten(fixed=False), _x(1), AXES, tmp_path / "m.onnx")
    assert "input 'x' axis 0 (batch) has example size 1" in str(e.value)
    assert "example with batch >= 2" in str(e.value)
    assert not (tmp_path / "m.onnx").exists()


def test_axis_fixed_to_one_blames_the_example(tmp_path):
    """A graph already fixed at batch 1 (e.g. exported elsewhere from a batch-1 example)."""
    path = tmp_path / "loop1.onnx"
    feeds = _x(1)
    torch.onnx.export(PerSample().eval(), (torch.from_numpy(feeds["x"]),), str(path), dynamo=True,
                      input_names=["x"], opset_version=19, external_data=False)
    with pytest.raises(ExportError) as e:
        ec.check_symbolic(onnx.load(str(path)), AXES)
    assert "input 'x' axis 0 (batch) was baked in as the constant 1" in str(e.value)
    assert "example with batch >= 2" in str(e.value)


def test_symbolic_input_with_baked_reshape_fails_at_another_batch(tmp_path):
    """An ONNX file whose input is symbolic but whose Reshape holds the example batch
    (as older exporters write it): the static scan names the node and the axis."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [2, 32])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="flatten")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])], [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    with pytest.raises(ExportError, match=r"input 'x' axis 0 \(batch\): Reshape node 'flatten'"):
        ec.check_symbolic(model, AXES)
    onnx.save(model, tmp_path / "r.onnx")
    from pipeline.ort_sessions import ort_session

    sess = ort_session(str(tmp_path / "r.onnx"))
    with pytest.raises(ExportError) as e:
        ec.run_point(model, sess, AXES, _x(3), [_x(3)["x"].reshape(3, 32)], (1e-4, 1e-4))
    assert "node 'flatten'" in str(e.value) and "[3, 4, 8]" in str(e.value)


def test_masked_row_feeds():
    feeds = {"ids": np.ones((3, 4), np.int64), "attention_mask": np.ones((3, 6), np.int64),
             "keep": np.ones((3, 4), bool), "x": np.ones((3, 4), np.float32)}
    masked, row = ec.with_masked_row(feeds)
    assert row == 2
    assert masked["attention_mask"][2].sum() == 0 and not masked["keep"][2].any()
    assert masked["attention_mask"][:2].all() and masked["keep"][:2].all()
    assert masked["x"] is feeds["x"] and feeds["attention_mask"].all()  # inputs untouched
    assert ec.with_masked_row({"attention_mask": np.ones((1, 6), np.int64)})[1] is None


def test_fully_masked_row_disagreement_is_named(tmp_path):
    with pytest.raises(ExportError) as e:
        _export_verify(Attention("float"), _attn_feeds(), ATTN_AXES, tmp_path)
    msg = str(e.value)
    assert "input 'mask' axis 1 (sequence) fully masked in row 1" in msg
    assert "output 'y' row 1: 40 finite in torch, NaN/Inf in ONNX Runtime" in msg
    assert "torch.finfo(dtype).min" in msg


def test_fully_masked_row_nan_in_both_is_undefined_not_a_fault(tmp_path):
    reports = _export_verify(Attention("fill"), _attn_feeds(), ATTN_AXES, tmp_path)
    masked = reports[-1]
    assert masked["row"] == 1 and masked["masked_inputs"] == ["mask"]
    assert masked["undefined_in_both"] == 5 * 8 and masked["finite_differ"] == 0
    assert [r["dims"] for r in reports[:-1]] == [{"batch": 3}, {"batch": 4}, {"sequence": 6}, {"sequence": 10}]


def test_fully_masked_row_finite_in_both_is_a_convention_not_a_fault(tmp_path):
    """torch's SDPA gives 0 for the row, the graph the mean of the masked keys: both finite."""
    masked = _export_verify(Attention("bool"), _attn_feeds(), ATTN_AXES, tmp_path)[-1]
    assert masked["undefined_in_both"] == 0 and masked["finite_differ"] > 0


def test_tiny_bert_encoder_passes_through_the_encoder_export(tmp_path):
    """A random 2-layer BERT, exported by the encoder adapter's own export, passes every check,
    its fully masked row included (mean pooling over no positions gives finite zeros in both)."""
    from transformers import BertConfig, BertModel

    from conftest import ROOT
    from pipeline.models.sentence_embedding.adapter import SentenceEmbeddingAdapter as EncoderAdapter
    from pipeline.models.sentence_embedding.model import INPUTS, PooledEncoder, random_feeds
    from pipeline.recipe.load import load_recipe

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=1200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    module = PooledEncoder(BertModel(cfg, add_pooling_layer=False).eval()).eval()
    export_cfg = load_recipe(ROOT / "recipes" / "int8-encoder.yaml").export
    adapter = EncoderAdapter(None)
    adapter.vocab = cfg.vocab_size
    path = tmp_path / "encoder.onnx"
    adapter.export(module, export_cfg, path)
    feeds = random_feeds(cfg.vocab_size, batch=2, sequence=7)
    reports = ec.verify_export(module, feeds, path, adapter.dynamic_axes(export_cfg),
                               run_torch=lambda f: [t.detach().numpy() for t in adapter.torch_outputs(module, f)],
                               tol=(1e-3, 1e-4))
    assert list(INPUTS) == ["input_ids", "attention_mask", "token_type_ids"]
    assert [r["dims"] for r in reports[:-1]] == [{"batch": 3}, {"batch": 4}, {"sequence": 8}, {"sequence": 14}]
    assert reports[-1]["masked_inputs"] == ["attention_mask"] and reports[-1]["undefined_in_both"] == 0


@pytest.mark.e2e  # a tiny-Llama export stage run (~16 s): make test runs it, make test-fast does not
def test_export_stage_checks_a_fully_masked_row_on_the_tiny_llama(tmp_path):
    """The export stage (run_pipeline, export only) on the tiny random Llama: the first
    point with batch >= 2 is also run with one row of attention_mask all zeros."""
    import json

    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline
    from tiny import make_tiny_llama, tiny_recipe

    path = tiny_recipe(tmp_path, make_tiny_llama(tmp_path / "model"))
    run_pipeline(load_recipe(path), path, quiet=True, only=["export"])
    stage = json.loads((tmp_path / "artifacts" / "tiny-llm" / "export" / "stage.json").read_text())
    checks = _find(stage, "shape_checks")
    masked = [c["masked_row"] for c in checks if "masked_row" in c]
    assert len(checks) == 4 and all(c["passed"] for c in checks)  # the recipe's 3 + the profile's minimum
    assert checks[-1]["point"] == {"batch": 1, "sequence": 1, "past_sequence": 0, "total_sequence": 1}
    assert len(masked) == 1 and masked[0]["row"] == 2 and masked[0]["masked_inputs"] == ["attention_mask"]
    assert masked[0]["undefined_in_both"] == 0  # finite in both; only the convention differs


def _find(obj, key):
    """The first value under ``key`` anywhere in a JSON tree."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    for v in obj if isinstance(obj, list) else []:
        found = _find(v, key)
        if found is not None:
            return found
    return None


def test_a_tolerance_key_matching_no_output_is_named():
    from pipeline.stages.export import check_tolerance_patterns

    outputs = ["logits", "last_logits", "present.0.key"]
    check_tolerance_patterns({"logits": 1, "present.*": 1}, outputs)
    with pytest.raises(ExportError, match=r"export.tolerances: \['logitz'\] match no graph output; the outputs are "
                                          r"\['logits', 'last_logits', 'present.0.key'\]"):
        check_tolerance_patterns({"logitz": 1, "present.*": 1}, outputs)
