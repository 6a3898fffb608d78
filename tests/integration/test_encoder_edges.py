"""A relative-position-bucket encoder (MPNet, as all-mpnet-base-v2): its bucket arithmetic
(``log(n / max_exact)``, ``-inf`` at n = 0, cast to int64) must stay FP32 in the naive ORT
baseline of validate, or every bucket index becomes -2^63 on inputs longer than the exact range."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

from pipeline.checks.export import export_module
from pipeline.models.sentence_embedding.metrics import index_arithmetic_nodes
from pipeline.models.sentence_embedding.model import PooledEncoder, random_feeds
from pipeline.ort_sessions import ort_session


class _Reader(CalibrationDataReader):
    def __init__(self, batches):
        self._it = iter(batches)

    def get_next(self):
        return next(self._it, None)


@pytest.fixture(scope="module")
def mpnet_graph(tmp_path_factory):
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(0)
    cfg = MPNetConfig(vocab_size=1100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=130)
    module = PooledEncoder(MPNetModel(cfg, add_pooling_layer=False).eval()).eval()
    out = tmp_path_factory.mktemp("mpnet") / "model.onnx"
    names = module.input_names  # MPNet's forward takes no token_type_ids
    assert names == ("input_ids", "attention_mask")
    export_module(module, random_feeds(1100, batch=2, sequence=7, names=names),
                  {n: {0: "batch", 1: "sequence"} for n in names}, out, opset=19, output_names=["embeddings"])
    return out


def test_bucket_arithmetic_is_found_and_kept_fp32(mpnet_graph, tmp_path):
    import onnx

    excluded = index_arithmetic_nodes(str(mpnet_graph))
    ops = {n.name: n.op_type for n in onnx.load(str(mpnet_graph)).graph.node}
    assert {"Log", "Div", "Cast"} <= {ops[n] for n in excluded}
    assert "MatMul" not in {ops[n] for n in excluded}  # the GEMMs are still quantized
    names = [i.name for i in onnx.load(str(mpnet_graph)).graph.input]
    calib = [random_feeds(1100, batch=4, sequence=32, seed=s, names=names) for s in range(2)]
    long = random_feeds(1100, batch=2, sequence=24, seed=9, names=names)  # distances past the exact buckets
    naive, kept = tmp_path / "naive.onnx", tmp_path / "kept.onnx"
    quantize_static(str(mpnet_graph), str(naive), _Reader(calib), quant_format=QuantFormat.QDQ)
    with pytest.raises(Exception, match="Gather"):  # what validate crashed on before
        ort_session(str(naive)).run(None, long)
    quantize_static(str(mpnet_graph), str(kept), _Reader(calib), quant_format=QuantFormat.QDQ,
                    nodes_to_exclude=excluded)
    got = ort_session(str(kept)).run(None, long)[0]
    ref = ort_session(str(mpnet_graph)).run(None, long)[0]
    assert np.isfinite(got).all()
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() > 0.9
