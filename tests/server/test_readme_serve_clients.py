"""README.md's lm-eval and AIPerf commands, parsed out of it and run as written against the tiny LM
served as ``smollm2_generate`` with fp8-llm's 513-token context: a real tritonserver and the OpenAI
endpoint. Two things are changed in each line, and nothing else: the endpoint's address (a free port,
not 8000) and ``.venv/bin/`` (this interpreter's folder). They run from a scratch folder holding
``examples`` (this checkout's) and ``model_repository`` (the served one), offline."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from serve_tiny import context_build, llm_artifacts, llm_recipe, stop_cleanly

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2_generate"
CONTEXT = 513  # fp8-llm's served context (past_sequence max 512 + 1)
ADDRESS = "http://127.0.0.1:8000"
#: the tiny tokenizer's chat template (AIPerf's default benchmark is chat)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def readme_commands() -> dict[str, str]:
    """The README block with the lm-eval and AIPerf lines: {"lm_eval": line, "aiperf": line}."""
    from test_docs_commands import blocks

    for _, _, _, lines in blocks(ROOT / "README.md"):
        found = {tool: line for line in lines for tool in ("lm_eval", "aiperf")
                 if line.startswith(f".venv/bin/{tool} ")}
        if len(found) == 2:
            return found
    raise AssertionError("README.md has no block with the .venv/bin/lm_eval and .venv/bin/aiperf commands")


@pytest.fixture(scope="module")
def served_here(tmp_path_factory):
    """(endpoint root URL, scratch folder): the tiny LM (WordLevel tokenizer: every word is in its
    11-token vocabulary) as smollm2_generate, context 513, and a folder to run the commands from."""
    pytest.importorskip("pytriton")
    from pipeline.serve.prepare import prepare
    from pipeline.serve.run import launch, start_endpoint
    from test_repository import tiny_tokenizer

    ws = tmp_path_factory.mktemp("readme_clients")
    tok = tiny_tokenizer(ws / "work" / "tokenizer")
    (tok / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    artifacts = llm_artifacts(ws, tokenizer_dir=tok, build=context_build(CONTEXT))
    served = prepare(llm_recipe(ws, generate_model_name=MODEL), artifacts, backends=["python"])
    here = ws / "checkout"
    here.mkdir()
    (here / "examples").symlink_to(ROOT / "examples")
    (here / "model_repository").symlink_to(served.repository)  # what `make build` publishes there
    server = launch(served)
    try:
        with start_endpoint(served, server, port=0) as endpoint:
            yield endpoint.url.removesuffix("/v1"), here
    finally:
        stop_cleanly(server, MODEL)


def run_as_written(line: str, root_url: str, here: Path) -> subprocess.CompletedProcess:
    """``line`` with the two changes above, from ``here``, offline; its own TMPDIR, removed after
    (AIPerf leaves folders there; a short one: its ZMQ sockets live under it)."""
    import shutil
    import tempfile

    assert ADDRESS in line and line.startswith(".venv/bin/"), line
    command = line.replace(ADDRESS, root_url).replace(".venv/bin/", f"{Path(sys.executable).parent}/", 1)
    tmp = tempfile.mkdtemp(prefix="readme-")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TMPDIR": tmp}
    try:
        return subprocess.run(command, shell=True, cwd=here, env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_readme_lm_eval_command_runs_offline(served_here):
    """No tokenizer argument: lm-eval finds /tokenizer_info and /tokenize at the root; max_length
    fits the context (some Lee documents are longer than it, so windows reach it)."""
    pytest.importorskip("lm_eval")
    root_url, here = served_here
    done = run_as_written(readme_commands()["lm_eval"], root_url, here)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "remote tokenizer" in done.stderr.lower(), done.stderr[-3000:]
    assert re.search(r"\|lee_validate\s*\|.*\|bits_per_byte\s*\|", done.stdout), done.stdout[-3000:]


def test_readme_aiperf_command_runs_offline_without_request_errors(served_here):
    """AIPerf's default chat benchmark (it sends messages[].name) with the served tokenizer folder."""
    pytest.importorskip("aiperf")
    from pipeline.serve.bench import aiperf_errors

    root_url, here = served_here
    done = run_as_written(readme_commands()["aiperf"], root_url, here)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    exports = sorted((here / "artifacts").glob(f"{MODEL}-openai-chat-*/profile_export_aiperf.json"))
    assert len(exports) == 1, (done.stdout + done.stderr)[-4000:]
    export = exports[0]
    data = json.loads(export.read_text())
    assert aiperf_errors(data) is None
    assert data["request_count"]["avg"] == 10 and data["input_sequence_length"]["avg"] == 128
