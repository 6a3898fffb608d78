"""Shared fixtures, and how the suite is split across pytest-xdist's workers.

The fp8-llm end-to-end run is made once per session. ``make test`` runs the suite on every core
(``-n auto --dist loadgroup``); :func:`pytest_collection_modifyitems` keeps the tests that share a
costly fixture on one worker and hands out the slowest groups first."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Test modules import helpers from one another by file name (``from test_repository import ...``): every
# folder of the suite is on the path, and each test file's name is unique across them (checked in
# tests/architecture/test_suite_split.py).
TEST_DIRS = sorted({p.parent for p in Path(__file__).resolve().parent.rglob("test_*.py")})
for _folder in TEST_DIRS:
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))
MOTO_BUCKET = "models"  # the bucket moto_s3 creates
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


#: Tests using these session fixtures (the real SmolLM2 export and fp8-llm run) share one worker.
SMOLLM2_FIXTURES = {"llm_workspace", "smollm2_export", "fp8_llm_run"}
#: Groups started first, slowest first (CI durations), so that no worker ends long after the other.
SLOW_FIRST = ["smollm2", "test_causal_lm_matrix.py", "test_publish_integrity.py", "test_runs.py",
              "test_shared_repository.py", "test_budget.py", "test_bench_openai.py", "test_bench_tiny.py",
              "test_recipe_data.py", "test_reproducible_bytes.py", "test_external_data.py"]


def xdist_group(item: pytest.Item) -> str | None:
    """The worker group of ``item``: its own ``xdist_group`` mark's; ``smollm2`` for the real-model
    tests; its module's file name when it uses a module-scoped fixture (built once per module);
    else None (any worker)."""
    if (mark := item.get_closest_marker("xdist_group")) is not None:
        return mark.args[0]
    if SMOLLM2_FIXTURES & set(item.fixturenames):
        return "smollm2"
    defs = getattr(item, "_fixtureinfo", None)
    scopes = [d.scope for ds in (defs.name2fixturedefs.values() if defs else []) for d in ds]
    return item.path.name if "module" in scopes or "class" in scopes else None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    groups = {}
    for item in items:
        group = groups[item.nodeid] = xdist_group(item)
        if group and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    rank = {g: i for i, g in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(groups[it.nodeid] or it.path.name, len(rank)))  # stable


@pytest.fixture(scope="session")
def llm_workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8-llm")


def llm_overrides(ws: Path, **extra) -> dict:
    return {"work_dir": str(ws / "artifacts"), "output_dir": str(ws / "model_repository"), **extra}


@pytest.fixture(scope="session")
def smollm2_export(llm_workspace) -> Path:
    """The export stage of the real fp8-llm recipe (SmolLM2-135M), made once per session: the
    flagship run below continues from it, and int8-llm, whose model and export section are the
    same (the same stage key), starts from its cache record. Returns the stage folder."""
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    path = ROOT / "recipes" / "fp8-llm.yaml"
    run_pipeline(load_recipe(path, llm_overrides(llm_workspace)), path, quiet=True, only=["export"])
    return llm_workspace / "artifacts" / "fp8-llm" / "export"


@pytest.fixture(scope="session")
def fp8_llm_run(llm_workspace, smollm2_export):
    """The real fp8-llm recipe, end to end, into a temporary workspace (export from :func:`smollm2_export`)."""
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    path = ROOT / "recipes" / "fp8-llm.yaml"
    recipe = load_recipe(path, llm_overrides(llm_workspace))
    return run_pipeline(recipe, path, quiet=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer (``tiny.make_tiny_llama``), made once per
    session. Tests copy it before changing any file in it."""
    from tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_export(tiny_model, tmp_path_factory) -> Path:
    """The export stage of ``tiny_recipe`` on :func:`tiny_model`, run once per session; returns
    its stage folder. Tests whose subject is not the export start from it (``tiny.seed_export``)."""
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline
    from tiny import tiny_recipe

    ws = tmp_path_factory.mktemp("tiny-export")
    path = tiny_recipe(ws, tiny_model)
    run_pipeline(load_recipe(path), path, quiet=True, only=["export"])
    return ws / "artifacts" / "tiny-llm" / "export"


@pytest.fixture(scope="module")
def moto_s3():
    """moto's S3 server on 127.0.0.1 (a free port) with test credentials in the environment,
    ``AWS_ENDPOINT_URL`` pointing at it and one bucket; stopped afterwards. Yields the endpoint."""
    from moto.server import ThreadedMotoServer

    from pipeline.triton.server import free_ports

    port = free_ports(1)[0]
    with pytest.MonkeyPatch.context() as mp:
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(key, raising=False)
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}.items():
            mp.setenv(key, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            import boto3

            boto3.client("s3").create_bucket(Bucket=MOTO_BUCKET)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.stop()
