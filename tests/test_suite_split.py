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
