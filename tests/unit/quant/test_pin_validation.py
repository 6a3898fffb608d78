"""A pin file (``recipes/tuned/<r>.json``) is validated like any input.

No model here: :func:`pipeline.quant.pin.read` on edited copies of the shipped pins, the graph binding
(``consumers``) on synthetic GEMMs, and ``tune``'s pre-flight refusals. The end-to-end refusals (exit
codes, the recipe's bounds on pinned exclusions, the console) are in tests/test_tuning_pin.py.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from pipeline.errors import QuantizationError, RecipeError
from pipeline.quant import pin
from pipeline.quant.qdq import Target

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = sorted(p for p in (ROOT / "recipes" / "tuned").glob("*.json")
                 if not p.name.endswith(".serving.json"))  # serving pins: tests/unit/triton/test_serving_pin.py


def _edited(tmp_path: Path, edit) -> Path:
    data = json.loads((ROOT / "recipes" / "tuned" / "fp8-llm.json").read_text())
    edit(data)
    out = tmp_path / "tuned" / "fp8-llm.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(data))  # NaN / Infinity as Python's json writes them
    return out


def _first(data: dict, key: str = "amax") -> str:
    return sorted(data[key])[0]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_the_shipped_pins_are_valid_and_bound_to_the_graph(path):
    data = pin.read(path)
    assert data["format"] == pin.FORMAT
    assert set(data["consumers"]) == set(data["amax"]) and all(data["consumers"].values())


@pytest.mark.parametrize("value, says", [
    ("abc", 'got "abc"'), (None, "got null"), ([1.0], "got [1.0]"), (True, "got true"),
    (math.nan, "finite"), (math.inf, "finite"), (-math.inf, "finite"), (0.0, "greater than 0"), (-1.5, "greater than 0")])
def test_a_hand_edited_amax_is_refused_naming_the_file_and_the_key(tmp_path, value, says):
    """C77: "abc", null and [1.0] were exit 3, true was taken as 1.0, NaN / inf blamed the calibration data."""
    name = {}

    def edit(d):
        name["act"] = _first(d)
        d["amax"][name["act"]] = value

    path = _edited(tmp_path, edit)
    with pytest.raises(RecipeError) as e:
        pin.read(path, retune="python -m pipeline tune x.yaml")
    text = str(e.value)
    assert str(path) in text and f'amax["{name["act"]}"]' in text and says in text
    assert "valid: a finite number > 0" in text and "re-create it with python -m pipeline tune x.yaml" in text


def test_an_integer_amax_is_a_number():
    """JSON has one number type: a hand-written ``2`` is 2.0, as ``2.0`` would be."""
    data = json.loads((ROOT / "recipes" / "tuned" / "fp8-llm.json").read_text())
    data["amax"][_first(data)] = 2
    pin.PinFile.model_validate(data)


@pytest.mark.parametrize("key, value, says", [
    ("format", 99, "format: not a format this version reads"), ("format", True, "format: Input should be a valid integer"),
    ("format", "1", "format: Input should be a valid integer"),
    ("excluded", "*", "excluded: Input should be a valid list"), ("excluded", [""], "excluded[0]: String should have"),
    ("excluded", [3], "excluded[0]: Input should be a valid string"),
    ("match", {"model": 1.5}, 'match["model"]'), ("metrics", {"kld_mean": "low"}, 'metrics["kld_mean"]'),
    ("channel_amax", {"x": "not base64!"}, 'channel_amax["x"]: Value error, not base64'),
    ("extra", 1, "extra: unknown key; valid keys: format, match, excluded, amax"),
])
def test_a_pin_of_the_wrong_shape_is_refused_naming_the_key(tmp_path, key, value, says):
    """C78: ``format: 99`` was accepted; the rest named no key or failed later."""
    path = _edited(tmp_path, lambda d: d.__setitem__(key, value))
    with pytest.raises(RecipeError, match="not a valid pinned tuning result") as e:
        pin.read(path)
    assert str(path) in str(e.value) and says.replace("Value error, ", "") in str(e.value)


def test_a_missing_key_and_a_non_object_are_refused(tmp_path):
    path = _edited(tmp_path, lambda d: d.pop("amax"))
    with pytest.raises(RecipeError, match=r"amax: missing"):
        pin.read(path)
    path.write_text("[1]")
    with pytest.raises(RecipeError, match=r"is a JSON object, not list"):
        pin.read(path)


def test_channel_amax_must_be_finite_non_negative_float32_of_a_pinned_tensor(tmp_path):
    import base64

    import numpy as np

    def b64(values):
        return base64.b64encode(np.asarray(values, "<f4").tobytes()).decode()

    for values, says in (([1.0, np.nan], "channel 1 is nan"), ([-1.0], "channel 0 is -1.0")):
        path = _edited(tmp_path, lambda d: d.__setitem__("channel_amax", {_first(d): b64(values)}))
        with pytest.raises(RecipeError, match=rf'channel_amax\["mul_\d+"\]: {says}'):
            pin.read(path)
    path = _edited(tmp_path, lambda d: d.__setitem__("channel_amax", {"nowhere": b64([1.0])}))
    with pytest.raises(RecipeError, match=r'channel_amax\["nowhere"\]: no amax\["nowhere"\] for it'):
        pin.read(path)


def test_consumers_must_cover_the_amax_tensors(tmp_path):
    path = _edited(tmp_path, lambda d: d["consumers"].pop(_first(d)))
    with pytest.raises(RecipeError, match=r"consumers: no entry for 1 amax tensors: \"mul_\d+\""):
        pin.read(path)


# --- the graph binding: amax are keyed by the exporter's positional names (mul_107)

def _gemms(names: dict[str, str]) -> list[Target]:
    """scope -> the tensor it reads, as weight GEMMs."""
    return [Target(f"node_{i}", scope, act, f"w{i}", 1) for i, (scope, act) in enumerate(names.items())]


GRAPH = {"layers.0.self_attn.q_proj": "mul_7", "layers.0.self_attn.k_proj": "mul_7",
         "layers.0.mlp.up_proj": "mul_9", "layers.0.mlp.down_proj": "mul_11"}


def test_graph_consumers_are_the_sorted_scopes_reading_each_tensor():
    assert pin.graph_consumers(_gemms(GRAPH), ["mul_7", "mul_11", "gone"]) == {
        "mul_7": ["layers.0.self_attn.k_proj", "layers.0.self_attn.q_proj"], "mul_11": ["layers.0.mlp.down_proj"],
        "gone": []}
    no_scope = [Target("node_3", "", "x", "w", 1)]
    assert pin.graph_consumers(no_scope, ["x"]) == {"x": ["node_3"]}


def test_a_renumbered_export_is_refused_though_every_name_still_exists(tmp_path):
    """An exporter that numbers its tensors otherwise (mul_9 now the down_proj input): every pinned
    name is still in the graph, so only the consumers tell the scales would move."""
    acts = sorted(set(GRAPH.values()))
    pinned = {"amax": {a: 1.0 for a in acts}, "consumers": pin.graph_consumers(_gemms(GRAPH), acts)}
    assert pin.check_consumers(pinned, _gemms(GRAPH), tmp_path / "p.json", "retune") is True
    renumbered = {**GRAPH, "layers.0.mlp.up_proj": "mul_11", "layers.0.mlp.down_proj": "mul_9"}
    with pytest.raises(QuantizationError) as e:
        pin.check_consumers(pinned, _gemms(renumbered), tmp_path / "p.json", "python -m pipeline tune r.yaml")
    text = str(e.value)
    assert text.startswith(f"{tmp_path / 'p.json'}: consumers[\"mul_11\"]: ")
    assert "tuned for layers.0.mlp.down_proj" in text and "feeds layers.0.mlp.up_proj" in text
    assert "(2 of 3 amax tensors differ)" in text and "re-tune (python -m pipeline tune r.yaml)" in text


def test_a_pin_without_consumers_is_applied_unchecked():
    """Pins written before ``consumers`` stay valid; the stage says they are unchecked."""
    assert pin.check_consumers({"amax": {"mul_7": 1.0}}, _gemms(GRAPH), Path("p.json"), "") is False


# --- tune's pre-flight


def _args(recipe: Path, *sets: str) -> argparse.Namespace:
    return argparse.Namespace(recipe=str(recipe), set=list(sets))


def test_tune_refuses_a_set_of_a_field_the_pin_matches():
    """C79: ``tune --set quantize.accuracy_budget.max=0.9`` overwrote the committed pin with one
    that matched that command line only; ``build --locked`` then exited 2 "stale"."""
    from pipeline.run.preflight import refuse_matched_sets as _refuse_matched_sets
    from pipeline.recipe.load import load_recipe, parse_set

    path = ROOT / "recipes" / "fp8-llm.yaml"
    dest = pin.pin_path(path, "fp8-llm")
    for sets in (["quantize.accuracy_budget.max=0.9"], ["quantize.calibration.samples=16", "work_dir=/tmp/w"],
                 ["model.source.file=other.gguf"]):
        with pytest.raises(RecipeError) as e:
            _refuse_matched_sets(_args(path, *sets), load_recipe(path, parse_set(sets)), dest)
        text = str(e.value)
        assert f"tune: --set {sets[0].partition('=')[0]} changes what the pin matches" in text
        assert "work_dir" not in text.partition(" changes")[0] and str(dest) in text and "stale" in text
    allowed = ["quantize.tuning.max_trials=7", "quantize.tuning.time_limit_s=60", "quantize.exclude.nodes=[x]",
               "work_dir=/tmp/w", "validate.max_windows=2"]
    _refuse_matched_sets(_args(path, *allowed), load_recipe(path, parse_set(allowed)), dest)


@pytest.mark.parametrize("code, exit_code", [("EROFS", 4), ("EACCES", 2)])
def test_tune_checks_the_pin_folder_before_any_work(tmp_path, monkeypatch, capsys, code, exit_code):
    """C91: a read-only pin folder was found after minutes of calibration and search (exit 4)."""
    import errno

    from pipeline import fsutil
    from pipeline.cli import app as cli
    from pipeline.run import runner

    recipe = tmp_path / "fp8-llm.yaml"
    recipe.write_text((ROOT / "recipes" / "fp8-llm.yaml").read_text())
    folder = tmp_path / "tuned"
    real = fsutil.folder_problem

    def refused(path):
        if Path(path) == folder:
            return OSError(getattr(errno, code), "refused", str(folder / ".write-probe-x"))
        return real(path)

    monkeypatch.setattr(fsutil, "folder_problem", refused)
    monkeypatch.setattr(runner, "run_tune", lambda *a, **k: pytest.fail("tune started work"))
    assert cli.main(["tune", str(recipe), "--quiet", "--set", f"work_dir={tmp_path / 'a'}",
                     "--set", f"output_dir={tmp_path / 'm'}"]) == exit_code
    err = capsys.readouterr().err
    assert str(folder) in err


def test_tune_refuses_a_pin_folder_that_is_a_file(tmp_path, monkeypatch, capsys):
    from pipeline.cli import app as cli
    from pipeline.run import runner

    recipe = tmp_path / "fp8-llm.yaml"
    recipe.write_text((ROOT / "recipes" / "fp8-llm.yaml").read_text())
    (tmp_path / "tuned").write_text("")
    monkeypatch.setattr(runner, "run_tune", lambda *a, **k: pytest.fail("tune started work"))
    assert cli.main(["tune", str(recipe), "--quiet", "--set", f"work_dir={tmp_path / 'a'}",
                     "--set", f"output_dir={tmp_path / 'm'}"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'tuned'}: the pin folder cannot be written ({tmp_path / 'tuned'} is a file, not a folder)" in err
