"""How ``make test`` splits the suite across pytest-xdist workers (tests/conftest.py)."""
from __future__ import annotations

import pytest

from conftest import xdist_group


@pytest.fixture(scope="module")
def module_value() -> int:
    return 1


def test_a_real_model_test_joins_the_smollm2_group(request, llm_workspace):
    assert xdist_group(request.node) == "smollm2"


def test_a_module_fixture_keeps_its_module_on_one_worker(request, module_value):
    assert xdist_group(request.node) == "test_suite_split.py"


def test_a_test_with_function_fixtures_goes_to_any_worker(request, tmp_path):
    assert xdist_group(request.node) is None


def test_loadgroup_really_groups_on_this_worker(request, llm_workspace):
    """Under ``--dist loadgroup`` xdist's worker suffixes a grouped test's node id with ``@group``
    and schedules by it; pytest 9.2 moved the node id where xdist 3.8 no longer renames it, and
    every group was silently split (two workers each built the real fp8-llm run)."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("checks xdist's grouping, so it runs only on a pytest-xdist worker under --dist loadgroup "
                    "(make test); in one process nothing is split")
    assert request.node.nodeid.endswith("@smollm2")


def test_every_test_file_name_is_unique_across_the_suite():
    """Test files import helpers from one another by file name (tests/conftest.py puts every folder on the
    path), so two test files of one name would shadow each other."""
    from collections import Counter

    from conftest import TEST_DIRS
    names = Counter(p.name for folder in TEST_DIRS for p in folder.glob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []


def test_no_test_folder_on_the_path_holds_a_folder():
    """A folder on ``sys.path`` makes its sub-folders importable as namespace packages: ``tests/unit`` on the
    path turned ``tests/unit/triton/`` into ``import triton`` for torch, which then took OpenAI's Triton for
    installed. Test files therefore sit only in leaf folders (and in ``tests/`` itself, beside its data)."""
    from conftest import ROOT, TEST_DIRS
    holders = [d for d in TEST_DIRS if d != ROOT / "tests" and any(p.is_dir() and p.name != "__pycache__" for p in d.iterdir())]
    assert holders == []
