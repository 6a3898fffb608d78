"""Shared fixtures. The fp8-llm end-to-end run is made once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def llm_workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8-llm")


def llm_overrides(ws: Path, **extra) -> dict:
    return {"work_dir": str(ws / "artifacts"), "output_dir": str(ws / "model_repository"), **extra}


@pytest.fixture(scope="session")
def fp8_llm_run(llm_workspace):
    """The real fp8-llm recipe, end to end, into a temporary workspace."""
    from pipeline.recipe_load import load_recipe
    from pipeline.runner import run_pipeline

    path = ROOT / "recipes" / "fp8-llm.yaml"
    recipe = load_recipe(path, llm_overrides(llm_workspace))
    return run_pipeline(recipe, path, quiet=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer (``tiny.make_tiny_llama``), made once per
    session. Tests copy it before changing any file in it."""
    from tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
