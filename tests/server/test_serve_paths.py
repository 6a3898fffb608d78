"""Serving from a folder whose path a python-backend stub cannot take, and a repository served in
place: the tiny LM on a real tritonserver.

The python backend starts each stub with ``bash -c`` and the paths unquoted, and the stub's Python
reads file names as ASCII: before, a space in the path left the stub unstarted and ``serve`` waited
its whole ready timeout, and Cyrillic letters failed the model load with a UnicodeEncodeError
(both exit 2). And the stub writes ``__pycache__/model.cpython-3XY.pyc`` into each version folder it
loads a model.py from, which verify-repo (and so publish) reported as files not published."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import EXIT_ENVIRONMENT
from serve_tiny import llm_artifacts, llm_recipe, stop_cleanly
from test_prepare import publish
from test_repository import reference_generate

MODEL = "tiny_generate"
#: A space and Cyrillic letters ("my models"), as a user's home folder may hold.
AWKWARD = "мои модели"


def served_in_place(ws: Path, ready_timeout_s: int = 120):
    """The tiny LM published into ``ws``/model_repository and served from there (target
    python-onnxruntime: what this server runs, so no serve copy)."""
    from pipeline.serve.prepare import prepare

    recipe = llm_recipe(ws, serve={"ready_timeout_s": ready_timeout_s}, target="python-onnxruntime")
    served = prepare(recipe, publish(recipe, llm_artifacts(ws)), backends=["python"])
    assert served.repository == Path(recipe.output_dir)
    return served


@pytest.mark.server
def test_a_repository_under_a_space_and_cyrillic_letters_serves_and_still_verifies_in_place(tmp_path, capsys):
    pytest.importorskip("pytriton")
    from pipeline.cli import app as cli
    from pipeline.serve.client import StreamClient
    from pipeline.serve.run import launch
    from pipeline.triton.publish import verify_repository

    served = served_in_place(tmp_path / AWKWARD)
    server = launch(served)  # its work folder (the log) is under the same path
    links = server.links
    try:
        assert links is not None and links.is_dir() and AWKWARD not in str(links)
        with StreamClient(server.grpc_url, timeout_s=120) as client:
            got = client.generate(MODEL, input_ids=[1, 2, 3], max_tokens=4, ignore_eos=True).tokens
        assert got == reference_generate(Path(served.artifacts["quantize"].onnx_path), [1, 2, 3], 4)
    finally:
        stop_cleanly(server, MODEL)
    assert not links.exists()
    assert verify_repository(served.repository) == []  # whatever the stub wrote beside its model.py
    assert cli.main(["verify-repo", str(served.repository)]) == 0, capsys.readouterr().err


@pytest.mark.server
def test_a_stub_that_cannot_start_fails_at_once_with_exit_4(tmp_path, monkeypatch):
    """With the links turned off, the stub's shell splits the path at the space: the log's
    ``bash: ...`` line ends the wait, well before the 300 s ready timeout it used to wait out."""
    pytest.importorskip("pytriton")
    from pipeline.serve.run import launch
    from pipeline.triton import server as triton_server

    served = served_in_place(tmp_path / "a b", ready_timeout_s=300)
    monkeypatch.setattr(triton_server, "stub_safe", lambda path: True)
    with pytest.raises(triton_server.TritonServerError) as err:
        launch(served)
    assert err.value.exit_code == EXIT_ENVIRONMENT
    assert "the python backend could not start a model's stub (bash: " in str(err.value), str(err.value)[-2000:]
    assert "not ready after" not in str(err.value)


def test_a_path_no_temporary_folder_can_link_is_refused_before_the_server_starts(tmp_path, monkeypatch):
    pytest.importorskip("pytriton")
    from pipeline.triton import server as triton_server

    started = []
    monkeypatch.setattr(triton_server.subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(triton_server, "_LINK_PARENTS", (lambda: str(tmp_path / "tmp dir"),
                                                          lambda: str(tmp_path / "missing")))
    repo = tmp_path / AWKWARD
    repo.mkdir()
    with pytest.raises(triton_server.TritonServerError) as err:
        triton_server.start_server(repo, workdir=tmp_path / "work")
    message = str(err.value)
    assert err.value.exit_code == EXIT_ENVIRONMENT and not started
    assert f"the model repository, {repo}, holds a space, a shell character or a non-ASCII letter" in message
    assert f"tried {tmp_path / 'tmp dir'} (not a plain path), {tmp_path / 'missing'} (No such file or directory)" in message
    assert "Set TMPDIR to a writable folder" in message
    assert not (tmp_path / "work" / "backends").exists()
