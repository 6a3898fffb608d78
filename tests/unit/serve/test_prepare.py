"""What pipeline.serve hands to tritonserver: the serve copy, the bench variants, the
python-onnxruntime template's one-time weight dequantization, the server's backends (seconds)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import PipelineError
from pipeline.serve.prepare import prepare, write_variants
from pipeline.triton.config import parse_config
from pipeline.stages.triton import write_repository
from pipeline.triton.server import ServerDist
from serve_tiny import llm_artifacts, llm_recipe
from test_repository import fake_pb_utils, llm_feeds, load_template, ort_session, snapshot


def publish(recipe, artifacts):
    """What the triton stage does: write recipe.output_dir; returns the artifacts with 'triton'."""
    a = artifacts
    art = write_repository(recipe, export=a["export"], quantized=a["quantize"], build=a["build"],
                           out_dir=Path(recipe.output_dir))
    return {**artifacts, "triton": art}


def test_missing_backend_serves_a_python_onnxruntime_copy_and_leaves_output_dir(tmp_path):
    recipe, artifacts = llm_recipe(tmp_path), llm_artifacts(tmp_path)  # target auto, no engine: onnxruntime
    artifacts = publish(recipe, artifacts)
    before = snapshot(Path(recipe.output_dir))
    served = prepare(recipe, artifacts, backends=["python"])
    assert served.target == "python-onnxruntime"
    assert served.repository == tmp_path / "artifacts" / "tiny-llm" / "serve_repository"
    assert "needs tritonserver's 'onnxruntime' backend; this server has only ['python']" in served.note
    assert snapshot(Path(recipe.output_dir)) == before
    cfg = parse_config((served.repository / "tiny" / "config.pbtxt").read_text())
    assert cfg.backend == "python" and cfg.parameters["dequantize_weights"].string_value == "once"
    assert served.models == ["tiny", "tiny_generate"] and served.generate_model == "tiny_generate"
    assert served.compute_in_process  # Triton's statistics of "tiny" never count the generation's steps
    assert set(json.loads((served.repository / "repository.json").read_text())["models"]) == {"tiny", "tiny_generate"}


def test_present_backend_serves_the_published_repository(tmp_path):
    recipe, artifacts = llm_recipe(tmp_path), llm_artifacts(tmp_path)
    artifacts = publish(recipe, artifacts)
    served = prepare(recipe, artifacts, backends=["onnxruntime", "python"])
    assert served.repository == Path(recipe.output_dir) and served.target == "onnxruntime"
    assert not served.compute_in_process  # the generation model calls "tiny" through BLS
    assert not (tmp_path / "artifacts" / "tiny-llm" / "serve_repository").exists()
    index = Path(recipe.output_dir) / "repository.json"
    data = json.loads(index.read_text())
    data["models"]["tiny_generate"]["recipe"] = "another-recipe"  # another build published over it
    index.write_text(json.dumps(data))
    with pytest.raises(PipelineError, match=r"does not hold recipe 'tiny-llm''s models \['tiny_generate'\]"):
        prepare(recipe, artifacts, backends=["onnxruntime", "python"])


def test_variants_are_the_compute_model_with_batching_and_instances_varied(tmp_path):
    recipe = llm_recipe(tmp_path, dynamic_batching={"max_queue_delay_microseconds": 300})
    served = prepare(recipe, llm_artifacts(tmp_path), backends=["python"])
    variants = write_variants(served)
    assert [(v.name, v.dynamic_batching, v.instances) for v in variants] == [
        ("tiny__db_off_i1", False, 1), ("tiny__db_off_i2", False, 2),
        ("tiny__db_on_i1", True, 1), ("tiny__db_on_i2", True, 2)]
    for v in variants:
        assert sorted(p.name for p in v.repository.iterdir()) == [".publish.lock", "repository.json", v.name]  # compute only
        cfg = parse_config((v.repository / v.name / "config.pbtxt").read_text())
        assert cfg.backend == "python" and cfg.max_batch_size == 4
        assert cfg.HasField("dynamic_batching") == v.dynamic_batching
        assert [g.count for g in cfg.instance_group] == [v.instances]
        if v.dynamic_batching:
            assert cfg.dynamic_batching.max_queue_delay_microseconds == 300
    unbatched = prepare(llm_recipe(tmp_path / "mbs0", max_batch_size=0, dynamic_batching=None),
                        llm_artifacts(tmp_path / "mbs0"), backends=["python"])
    assert write_variants(unbatched) == []


def test_weights_dequantized_once_give_bit_identical_outputs(tmp_path, monkeypatch):
    """The python-onnxruntime template feeds each constant DequantizeLinear's result instead of
    recomputing it; outputs must equal the unchanged graph's exactly, batched or not."""
    fake_pb_utils(monkeypatch)
    recipe, artifacts = llm_recipe(tmp_path, target="python-onnxruntime", generate_model_name=None), llm_artifacts(tmp_path)
    publish(recipe, artifacts)
    model = load_template(Path(recipe.output_dir) / "tiny")
    assert sorted(model.weights) == ["lm_head_dq"]  # the weight's Q -> DQ; the activation's stay
    assert "lm_head_dq" in {i.name for i in model.session.get_inputs()}
    reference = ort_session(artifacts["quantize"].onnx_path)
    for batch, seq in [(1, 5), (3, 2)]:
        feeds = llm_feeds(batch, seq, seed=batch)
        got = model._session_run(feeds)
        for name, want, have in zip(model.output_names, reference.run(model.output_names, feeds), got):
            assert np.array_equal(want, have), name


def test_intra_op_threads_split_the_cpus_between_instances(tmp_path, monkeypatch):
    fake_pb_utils(monkeypatch)
    recipe = llm_recipe(tmp_path, target="python-onnxruntime", generate_model_name=None)
    publish(recipe, llm_artifacts(tmp_path))
    model = load_template(Path(recipe.output_dir) / "tiny")
    threads = model.initialize.__globals__["intra_op_threads"]
    cpus = len(os.sched_getaffinity(0))
    assert threads({"instance_group": [{"count": 1}]}, {}) == 0  # ONNX Runtime's default
    assert threads({"instance_group": [{"count": 2}]}, {}) == max(1, cpus // 2)
    assert threads({"instance_group": [{"count": 1}, {"count": 3}]}, {}) == max(1, cpus // 4)
    assert threads({"instance_group": [{"count": 2}]}, {"intra_op_threads": "3"}) == 3


def test_server_backends_are_the_folders_of_its_backend_directory(tmp_path):
    for name in ("python", "onnxruntime", "__pycache__"):
        (tmp_path / "backends" / name).mkdir(parents=True)
    (tmp_path / "backends" / "README").write_text("not a backend")
    dist = ServerDist(tmp_path / "bin", tmp_path / "libs", tmp_path / "backends" / "python", tmp_path / "stub")
    assert dist.backends == ["onnxruntime", "python"]


def test_endpoint_flags_for_a_recipe_without_a_generation_model_are_said_to_be_unused(monkeypatch):
    """An encoder has no OpenAI endpoint: --openai-port and --host were ignored without a word."""
    from types import SimpleNamespace

    from pipeline.serve import run

    seen = {}
    monkeypatch.setattr(run, "_serve", lambda served, sock, **kw: seen.update(sock=sock, **kw) or 0)
    lines: list[str] = []
    encoder = SimpleNamespace(generate_model=None)
    assert run.serve_forever(encoder, log=lines.append, host="0.0.0.0", openai_port=99999) == 0
    assert lines == ["note: this recipe has no generation model, so no OpenAI endpoint: --host, --openai-port and "
                     "--api-key are not used"]
    assert seen["sock"] is None and seen["host"] == "127.0.0.1" and seen["key"] is None  # no key demanded either
    lines.clear()
    assert run.serve_forever(encoder, log=lines.append) == 0 and lines == []


def test_the_cli_lets_an_encoder_serve_with_host_flags_it_does_not_use(monkeypatch, capsys):
    from types import SimpleNamespace

    from conftest import ROOT
    from pipeline.cli import app as cli
    from pipeline.serve import run

    monkeypatch.delenv("PIPELINE_API_KEY", raising=False)
    monkeypatch.setattr(cli, "_served", lambda args, recipe=None: SimpleNamespace(generate_model=None))
    monkeypatch.setattr(run, "_serve", lambda served, sock, **kw: 0)
    assert cli.main(["serve", str(ROOT / "recipes" / "int8-encoder.yaml"), "--host", "0.0.0.0"]) == 0  # no key asked
    assert "--host, --openai-port and --api-key are not used" in capsys.readouterr().out
