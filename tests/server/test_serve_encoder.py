"""Encoder repositories: tokenizer model + text -> embedding ensemble, checked, served for real,
and bench's non-LLM path on a tiny BERT-like model."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from pipeline.errors import TritonConfigError
from pipeline.serve.prepare import prepare
from pipeline.triton.config import check_ensemble, parse_config
from serve_tiny import encoder_artifacts, encoder_recipe
from test_prepare import publish
from test_repository import FakeRequest, fake_pb_utils, load_template, ort_session

SENTENCES = ["The cat sat on the mat.", "A dog ran in the park and it is a dog of the park.", "zebra"]


def reference_embeddings(artifacts: dict, texts: list[str], multiple: int = 16) -> np.ndarray:
    """What the ensemble computes: tokenize, pad to a multiple of 16, run the graph (ORT, basic)."""
    tok = Tokenizer.from_file(str(Path(artifacts["export"].tokenizer_dir) / "tokenizer.json"))
    session = ort_session(artifacts["quantize"].onnx_path)
    rows = []
    for text in texts:
        e = tok.encode(text)
        length = -(-len(e.ids) // multiple) * multiple
        feeds = {n: np.zeros((1, length), np.int64) for n in ("input_ids", "attention_mask", "token_type_ids")}
        feeds["input_ids"][0, : len(e.ids)] = e.ids
        feeds["attention_mask"][0, : len(e.ids)] = 1
        rows.append(session.run(["embeddings"], feeds)[0][0])
    return np.stack(rows)


def test_encoder_repository_has_tokenizer_and_ensemble(tmp_path):
    recipe = encoder_recipe(tmp_path, target="onnxruntime")
    artifacts = publish(recipe, encoder_artifacts(tmp_path))
    repo = Path(recipe.output_dir)
    assert artifacts["triton"].models == ["tiny_enc", "tiny_enc_tokenizer", "tiny_enc_ensemble"]
    tok = parse_config((repo / "tiny_enc_tokenizer" / "config.pbtxt").read_text())
    assert tok.backend == "python" and tok.max_batch_size == 8
    assert {k: v.string_value for k, v in tok.parameters.items()} == {
        "max_length": "64", "pad_id": "0", "pad_to_multiple_of": "16"}  # profile's input_ids max, [PAD]
    assert sorted(p.name for p in (repo / "tiny_enc_tokenizer" / "1").iterdir()) == [
        "model.py", "tokenizer.json", "tokenizer_config.json"]
    ens = parse_config((repo / "tiny_enc_ensemble" / "config.pbtxt").read_text())
    assert ens.platform == "ensemble" and ens.max_batch_size == 8
    assert [(t.name, list(t.dims)) for t in ens.input] == [("text", [1])]
    assert [(t.name, list(t.dims)) for t in ens.output] == [("embeddings", [8])]
    assert [s.model_name for s in ens.ensemble_scheduling.step] == ["tiny_enc_tokenizer", "tiny_enc"]
    assert list((repo / "tiny_enc_ensemble" / "1").iterdir()) == []
    index = json.loads((repo / "repository.json").read_text())["models"]
    assert index["tiny_enc_ensemble"]["backend"] == "ensemble" and index["tiny_enc"]["backend"] == "onnxruntime_onnx"


def test_ensemble_check_refuses_broken_wiring(tmp_path):
    recipe = encoder_recipe(tmp_path)
    publish(recipe, encoder_artifacts(tmp_path))
    repo = Path(recipe.output_dir)
    models = {n: parse_config((repo / n / "config.pbtxt").read_text()) for n in ("tiny_enc", "tiny_enc_tokenizer")}
    ens = parse_config((repo / "tiny_enc_ensemble" / "config.pbtxt").read_text())
    check_ensemble(ens, models)
    broken = parse_config((repo / "tiny_enc_ensemble" / "config.pbtxt").read_text())
    broken.ensemble_scheduling.step[1].input_map["token_type_ids"] = "nothing"
    with pytest.raises(TritonConfigError, match=r"step\[1\].input_map\['token_type_ids'\]: tensor 'nothing' \(missing\)"):
        check_ensemble(broken, models)
    with pytest.raises(TritonConfigError, match=r"step\[0\]: model 'tiny_enc_tokenizer' is not in the repository"):
        check_ensemble(ens, {"tiny_enc": models["tiny_enc"]})
    del models["tiny_enc"].output[:]
    with pytest.raises(TritonConfigError, match=r"step\[1\].output_map\['embeddings'\]: 'tiny_enc' has no output"):
        check_ensemble(ens, models)


def test_encoder_without_pad_token_is_refused(tmp_path):
    recipe, artifacts = encoder_recipe(tmp_path), encoder_artifacts(tmp_path)
    (Path(artifacts["export"].tokenizer_dir) / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TritonConfigError, match="no pad_token in tokenizer_config.json"):
        publish(recipe, artifacts)
    out = Path(recipe.output_dir)  # nothing published: at most the repository's lock file
    assert not out.exists() or [p.name for p in out.iterdir()] in ([], [".publish.lock"])


def test_tokenizer_template_pads_each_request_to_a_multiple(tmp_path, monkeypatch):
    fake_pb_utils(monkeypatch)
    recipe = encoder_recipe(tmp_path)
    artifacts = publish(recipe, encoder_artifacts(tmp_path))
    model = load_template(Path(recipe.output_dir) / "tiny_enc_tokenizer")
    tok = Tokenizer.from_file(str(Path(artifacts["export"].tokenizer_dir) / "tokenizer.json"))
    requests = [FakeRequest(text=np.array([[s.encode()] for s in SENTENCES[:2]], dtype=np.object_)),
                FakeRequest(text=np.array([[b"the cat " * 40]], dtype=np.object_))]
    first, long = model.execute(requests)
    ids, mask = first.outputs["input_ids"], first.outputs["attention_mask"]
    assert ids.shape == (2, 32) and ids.dtype == np.int64 and first.outputs["token_type_ids"].shape == (2, 32)  # 17 -> 32
    for row, text in enumerate(SENTENCES[:2]):
        e = tok.encode(text).ids
        assert ids[row, : len(e)].tolist() == e and not ids[row, len(e):].any()
        assert mask[row].sum() == len(e)
    assert long.outputs["input_ids"].shape == (1, 64)  # truncated to max_length, a multiple of 16


@pytest.mark.server
def test_real_server_embeds_text_and_bench_reads_its_statistics(tmp_path):
    pytest.importorskip("pytriton")
    import tritonclient.grpc as grpcclient

    from pipeline.serve.bench import bench_encoder, bench_variants
    from pipeline.serve.prepare import write_variants
    from pipeline.serve.run import launch

    serve = {"concurrency": [1, 4], "requests_per_level": 8, "bucket_tokens": 16, "batching_concurrency": 8,
             "batching_requests": 16}
    recipe = encoder_recipe(tmp_path, serve=serve)
    artifacts = publish(recipe, encoder_artifacts(tmp_path))
    served = prepare(recipe, artifacts, backends=["python"])
    assert served.repository == Path(recipe.output_dir)  # python-onnxruntime: served as published
    variants = write_variants(served)
    server = launch(served, extra_repositories=[v.repository for v in variants])
    try:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            text = grpcclient.InferInput("text", [3, 1], "BYTES")
            text.set_data_from_numpy(np.array([[s.encode()] for s in SENTENCES], dtype=np.object_))
            got = client.infer("tiny_enc_ensemble", [text]).as_numpy("embeddings")
        # One request of 3 rows pads them to one length; each row alone pads to its own.
        assert got.shape == (3, 8)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(got[:1], reference_embeddings(artifacts, SENTENCES[:1]), rtol=1e-5, atol=1e-6)
        sweep = bench_encoder(served, server, log=lambda line: None)
        batching = bench_variants(served, server, variants, log=lambda line: None)
    finally:
        code = server.stop()
    assert code == 0, server.logs()[-3000:]
    for level in sweep["levels"]:
        b = level["compute_batches"]
        assert level["requests"] == 8 and 0 <= level["slo_met"] <= 1
        assert level["latency_ms"]["p50"] <= level["latency_ms"]["p90"] <= level["latency_ms"]["p99"]
        assert sum(int(k) * n for k, n in b["executions_by_batch_size"].items()) == b["inferences"] == 8
    rows = {(r["dynamic_batching"], r["instances"]): r for r in batching["variants"]}
    for (dynamic, _), row in rows.items():
        sizes = {int(k): n for k, n in row["batches"]["executions_by_batch_size"].items()}
        assert sum(k * n for k, n in sizes.items()) == 16
        if not dynamic:
            assert set(sizes) == {1}  # without the dynamic batcher every request runs alone
    # 8 clients, 50 ms queue delay, one instance: the dynamic batcher must have formed batches.
    assert max(int(k) for k in rows[(True, 1)]["batches"]["executions_by_batch_size"]) > 1
    assert set(batching["ratios"]) == {"dynamic_batching_on_over_off_1_instance", "dynamic_batching_on_over_off_2_instances",
                                       "instances_2_over_1_batching_off", "instances_2_over_1_batching_on"}
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))
    with pytest.raises(ProcessLookupError):
        os.kill(server.process.pid, 0)
