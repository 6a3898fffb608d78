"""A pinned tuning result (``tune``, ``build --locked``) and a search robust to float noise."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from pipeline.cli.app import main
from pipeline.quant import budget, pin
from pipeline.quant import sensitivity as S
from pipeline.recipe.schema import Gate
from tiny import seed_export, tiny_recipe

TUNING = {"type": "corpus", "name": "lee_background", "split": {"start": 200, "stop": 215}}


# --- the search against a seeded fake runner: additive true gains, float noise below the tolerance


@dataclass
class FakeRunner:
    """What the searches use of :class:`TrialRunner`; the metric is ``base - sum(gain of reverted)``
    plus seeded noise of at most ``noise`` per trial."""

    gains: dict[str, float]
    base: float
    noise: float
    seed: int
    trials: list = field(default_factory=list)

    def __post_init__(self):
        self.targets = [type("T", (), {"node": g, "scope": g})() for g in self.gains]
        self.group_nodes = {g: [g] for g in self.gains}
        self.rng = random.Random(self.seed)

    def nodes_of(self, groups):
        return {n for g in groups for n in self.group_nodes[g]}

    def measure(self, groups, batches=None):
        value = self.base - sum(self.gains[g] for g in groups) + self.rng.uniform(-self.noise, self.noise)
        t = S.Trial(sorted(groups), len(groups), {"kld_mean": value, "relative_perplexity_increase": 0.0,
                                                  "top1_agreement": 1.0}, 0.0, 8)
        self.trials.append(t)
        return t


#: 40 GEMMs: a few clear ones, then runs of exact ties (equal true gains), then a tail
GAINS = {**{f"layers.{i}.down_proj": 0.004 - 0.0002 * i for i in range(6)},
         **{f"layers.{i}.gate_proj": 0.0012 for i in range(10)},
         **{f"layers.{i}.up_proj": 0.0007 for i in range(10)},
         **{f"layers.{i}.q_proj": 0.0001 for i in range(14)}}
GATE = Gate(metric="kld_mean", max=0.02)


def _fine(seed: int, noise: float):
    runner = FakeRunner(GAINS, base=0.045, noise=noise, seed=seed)
    rng = random.Random(1000 + seed)
    proxy = {g: v + rng.uniform(-noise, noise) for g, v in GAINS.items()}  # the proxy is noisy too
    tol = budget.Tolerance.of(GATE, noise)
    return budget.search_fine(runner, proxy, GATE, total_gemms=40, min_fraction=0.0, max_trials=50,
                              time_limit_s=600, tol=tol)


def test_fine_search_choice_does_not_move_with_float_noise_below_the_tolerance():
    noise = 2e-6  # Tolerance: max(10 x noise, 1 % of 0.02) = 2e-4, 100x the noise
    assert budget.Tolerance.of(GATE, noise).value == pytest.approx(2e-4)
    chosen = {tuple(sorted(_fine(seed, noise).excluded_groups)) for seed in range(12)}
    assert len(chosen) == 1, chosen
    (best,) = chosen
    res = _fine(0, noise)
    assert res.status == "met" and res.metrics["kld_mean"] <= GATE.max - 2e-4 + 2 * noise
    # ties go by name: of the ten equal gate_proj gains, the lowest names are reverted first
    gates = sorted(g for g in best if "gate_proj" in g)
    assert gates == sorted(f"layers.{i}.gate_proj" for i in range(10))[: len(gates)]


def test_greedy_search_choice_does_not_move_with_float_noise():
    groups = {"down_proj": 0.012, "gate_proj": 0.006, "up_proj": 0.006, "q_proj": 0.001, "k_proj": 0.001}
    chosen = set()
    for seed in range(12):
        runner = FakeRunner(groups, base=0.035, noise=2e-6, seed=seed)
        rng = random.Random(seed)
        rows = [{"group": g, "gemms": 1, "metric_value": 0.0, "improvement": v + rng.uniform(-2e-6, 2e-6)}
                for g, v in groups.items()]
        sens = S.Sensitivity("kld_mean", 0.035, sorted(rows, key=lambda r: -r["improvement"]), 8)
        res = budget.search(runner, sens, GATE, total_gemms=5, min_fraction=0.0, max_trials=50, time_limit_s=600,
                            tol=budget.Tolerance.of(GATE, 2e-6))
        chosen.add(tuple(sorted(res.excluded_groups)))
    assert chosen == {("down_proj", "gate_proj")}  # gate_proj ties up_proj and wins by name


def test_the_ranking_does_not_depend_on_the_bound():
    """Ties follow the float noise, not the bound: a loose bound must not merge real differences."""
    orders = {tuple(budget.rank(GAINS, budget.Tolerance.of(Gate(metric="kld_mean", max=m), 2e-9).tie))
              for m in (0.015, 0.021, 0.0265, 0.05)}
    assert len(orders) == 1
    (order,) = orders
    assert order[:6] == tuple(f"layers.{i}.down_proj" for i in range(6))


def test_a_trial_within_the_tolerance_of_the_bound_misses():
    assert budget.passes(GATE, {"kld_mean": 0.0199}, tol=0.0)
    assert not budget.passes(GATE, {"kld_mean": 0.0199}, tol=2e-4)
    assert budget.passes(GATE, {"kld_mean": 0.0197}, tol=2e-4)
    low = Gate(metric="top1_agreement", min=0.9)
    assert not budget.passes(low, {"top1_agreement": 0.9005}, tol=1e-3)


def test_rank_breaks_ties_by_name_and_keeps_clear_gaps():
    values = {"b": 1.0, "a": 1.0 + 1e-9, "c": 0.5, "e": 0.2, "d": 0.2 - 1e-9}
    assert budget.rank(values, 1e-6) == ["a", "b", "c", "d", "e"]
    assert budget.rank(values, 0.0) == ["a", "b", "c", "e", "d"]


# --- tune, pin and --locked on the tiny model, end to end


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, tiny_model, tiny_export):
    """A tiny recipe with a reachable kld_mean budget (GEMM by GEMM), tuned once: (ws, recipe path)."""
    ws = tmp_path_factory.mktemp("pin")
    seed_export(ws, tiny_export)
    path = tiny_recipe(ws, tiny_model, **{
        "quantize.tuning": {"data": TUNING, "max_windows": 4}, "quantize.exclude": {"nodes": []},
        "quantize.sensitivity": {"groups": "per_projection", "refine": True},
        "quantize.accuracy_budget": {"metric": "kld_mean", "max": 1.0}})  # loose: met at once
    assert main(["tune", str(path), "--quiet"]) == 0
    return ws, path


def test_tune_writes_a_pin_beside_the_recipe(tuned):
    ws, path = tuned
    data = pin.read(pin.pin_path(path, "tiny-llm"))
    assert data["match"]["search_version"] == pin.SEARCH_VERSION
    assert set(data["match"]) >= {"model", "quantize", "quantize.calibration.data", "quantize.tuning.data"}
    assert data["amax"] and all(v > 0 for v in data["amax"].values())
    assert "cpu" in data["recorded"] and "versions" in data["recorded"]
    assert Path(pin.pin_path(path, "tiny-llm")).parent == ws / "tuned"  # outside the recipes glob


def test_tune_refuses_a_precision_without_calibration_even_with_a_calibration_section(tuned, capsys):
    """An fp16 run writes no candidate; a leftover int8 one must never be pinned in its name."""
    ws, path = tuned
    before = pin.pin_path(path, "tiny-llm").read_bytes()
    fp16 = ["quantize.precision=fp16", "quantize.accuracy_budget=null", "quantize.sensitivity=null"]
    assert main(["tune", str(path), "--quiet", *[a for s in fp16 for a in ("--set", s)]]) == 2
    assert "quantize.precision 'fp16' has no calibration or search to pin" in capsys.readouterr().err
    assert pin.pin_path(path, "tiny-llm").read_bytes() == before


def test_build_uses_the_pin_and_quantizes_the_same_bytes(tuned):
    ws, path = tuned
    run = ws / "artifacts" / "tiny-llm"
    searched = (run / "quantize" / "model.onnx").read_bytes()
    assert main(["build", str(path), "--locked", "--quiet"]) == 0
    man = json.loads((run / "manifest.json").read_text())
    assert man["tuning"]["source"] == pin.PINNED
    assert man["artifacts"]["quantize"]["calibration"]["tuning"]["source"] == pin.PINNED
    assert (run / "quantize" / "model.onnx").read_bytes() == searched
    assert "Tuning: **pinned** result" in (run / "report.md").read_text()


def test_locked_refuses_a_stale_pin_naming_the_input(tuned, capsys):
    ws, path = tuned
    stale = ["--set", "quantize.tuning.data.split.stop=214"]
    assert main(["build", str(path), "--locked", "--quiet", *stale]) == 2
    err = capsys.readouterr().err
    assert "--locked" in err and "stale" in err and "the quantize section changed" in err
    assert f"python -m pipeline tune {path} re-tunes)" in " ".join(err.split())
    assert "made with clip:max,wclip:max" in " ".join(err.split())  # the method the pin was made with
    assert main(["build", str(path), "--locked", "--quiet", "--set", "quantize.tuning.max_trials=7"]) == 0


def _renamed_copy(path: Path, name: str) -> Path:
    """``path``'s recipe as ``<name>.yaml`` beside it, named ``tiny-<name>`` (so no pin of its own)."""
    data = yaml.safe_load(path.read_text())
    data["name"] = f"tiny-{name}"
    data["triton"].update(model_name=f"{name}_fp8", generate_model_name=f"{name}_generate")
    copy = path.with_name(f"{name}.yaml")
    copy.write_text(yaml.safe_dump(data))
    return copy


def test_locked_refuses_a_missing_pin(tuned, capsys):
    ws, path = tuned
    other = _renamed_copy(path, "other")
    assert main(["build", str(other), "--locked", "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (ws / "artifacts" / "tiny-other" / "quantize" / "model.onnx").exists()


def test_a_missing_pin_names_the_tune_command_for_the_recipe_path_as_given(tmp_path):
    from pipeline.recipe.load import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "fp8-llm.yaml")
    found = pin.lookup(recipe, Path("myproj/my-gpt2.yaml"), {})
    assert found.pinned is None
    assert found.reason == "myproj/tuned/fp8-llm.json does not exist (python -m pipeline tune myproj/my-gpt2.yaml writes it)"
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "fp8-llm.json").write_text("[]")
    with pytest.raises(Exception, match=rf"re-create it with python -m pipeline tune {tmp_path}/r.yaml"):
        pin.lookup(recipe, tmp_path / "r.yaml", {})


def test_a_pin_that_is_not_json_is_bad_input(tmp_path):
    bad = tmp_path / "tuned" / "x.json"
    bad.parent.mkdir()
    bad.write_text("{")
    with pytest.raises(Exception, match=r"x.json: not a readable pinned tuning result"):
        pin.read(bad)


def test_an_unreachable_fine_search_reports_its_closest_miss():
    runner = FakeRunner(GAINS, base=0.045, noise=0.0, seed=0)
    gate = Gate(metric="kld_mean", max=0.001)
    res = budget.search_fine(runner, dict(GAINS), gate, total_gemms=40, min_fraction=0.5, max_trials=50,
                             time_limit_s=600, tol=budget.Tolerance.of(gate, 0.0))
    assert res.status == "unreachable"
    measured = [t.metrics["kld_mean"] for t in runner.trials]
    assert res.metrics["kld_mean"] == min(measured) < 0.045
    assert len(res.excluded_groups) == 20  # the floor: half of the 40 GEMMs stay quantized


def test_a_quantize_field_added_at_its_default_keeps_older_pins():
    """``quantize.reduce_range`` came after pins were first written: at False the digest is the
    one without the field; set, it is another graph and the pin is stale."""
    from pipeline.recipe.load import load_recipe

    full_range = load_recipe("recipes/int8-llm.yaml", overrides={"quantize.reduce_range": False})
    inputs = {"model_file": {"sha256": "m"}}
    without = full_range.quantize.model_dump(mode="json")
    without.pop("reduce_range")
    without["exclude"].pop("nodes")
    for k in ("max_trials", "time_limit_s"):
        without["tuning"].pop(k)
    assert pin.match_fields(full_range, inputs)["quantize"] == pin._digest(without)
    seven_bit = load_recipe("recipes/int8-llm.yaml", overrides={"quantize.reduce_range": True})
    assert pin.match_fields(seven_bit, inputs)["quantize"] != pin._digest(without)


def test_a_build_without_its_pin_says_so_on_the_console(tuned, capsys):
    """A recipe copied without its tuned/ file calibrates and searches anew: the console says why
    (not only report.md), naming the pin it looked for and the command that writes it."""
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    ws, path = tuned
    copied = _renamed_copy(path, "copied")
    run_pipeline(load_recipe(copied), copied, quiet=False, only=["export", "quantize"])
    out = capsys.readouterr()
    assert (f"quantize: no pinned result used: {copied.parent / 'tuned' / 'tiny-copied.json'} does not exist "
            f"(python -m pipeline tune {copied} writes it); calibrating and searching") in out.out + out.err


# --- the pin is validated like any input, and the recipe's bounds apply to it


def _pinned_copy(tuned, tiny_export, name: str, edit=None, **changes) -> Path:
    """A renamed copy of the tuned recipe (``changes``: dotted recipe overrides) with its own pin: the
    tuned one, matched to the copy's quantize section, then ``edit``-ed; the export is seeded."""
    from pipeline.recipe.load import load_recipe

    ws, path = tuned
    copy = _renamed_copy(path, name)
    if changes:
        data = yaml.safe_load(copy.read_text())
        for dotted, value in changes.items():
            node = data
            *keys, last = dotted.split(".")
            for k in keys:
                node = node[k]
            node[last] = value
        copy.write_text(yaml.safe_dump(data))
    content = json.loads(pin.pin_path(path, "tiny-llm").read_text())
    content["match"]["quantize"] = pin.match_fields(load_recipe(copy), {})["quantize"]
    if edit is not None:
        edit(content)
    pin.pin_path(copy, f"tiny-{name}").write_text(json.dumps(content))
    seed_export(ws, tiny_export, f"tiny-{name}")
    return copy


def test_tune_binds_each_amax_to_the_gemms_that_read_it(tuned):
    data = pin.read(pin.pin_path(tuned[1], "tiny-llm"))
    assert set(data["consumers"]) == set(data["amax"])
    scopes = sorted(s for v in data["consumers"].values() for s in v)
    assert len(scopes) == 14 and len(set(scopes)) == 14 and all("layers." in s for s in scopes)


@pytest.mark.parametrize("value", ["abc", float("nan")], ids=["string", "nan"])
def test_a_hand_edited_amax_is_bad_input_naming_the_pin_and_key(tuned, tiny_export, capsys, value):
    """C77: "abc" was exit 3 (please report it); NaN was exit 2 blaming the calibration data."""
    act = {}

    def edit(d):
        act["name"] = sorted(d["amax"])[0]
        d["amax"][act["name"]] = value

    copy = _pinned_copy(tuned, tiny_export, "bad-amax", edit)
    assert main(["build", str(copy), "--locked", "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{pin.pin_path(copy, 'tiny-bad-amax')}: not a valid pinned tuning result" in err
    assert f'amax["{act["name"]}"]' in err and "calibration data" not in err and "internal error" not in err


@pytest.mark.parametrize("excluded, changes, says", [
    (["*"], {}, "leaves no weight GEMM quantized"),
    (["*mlp*"], {"quantize.tuning.min_quantized_fraction": 0.7},
     "8 of 14 (57.1%) quantized: that goes below quantize.tuning.min_quantized_fraction (0.7)"),
    (["*layers.0.mlp.down_proj", "no.such.scope"], {}, "excluded[1]: 'no.such.scope' matches no weight GEMM"),
], ids=["all", "below-floor", "unknown"])
def test_pinned_exclusions_are_held_to_the_recipes_bounds(tuned, tiny_export, capsys, excluded, changes, says):
    """C78: ``excluded: ["*"]`` built under --locked, exited 0 and published an fp8 model with no
    GEMM quantized; ``["*mlp*"]`` went below tuning.min_quantized_fraction."""
    copy = _pinned_copy(tuned, tiny_export, "bounds", lambda d: d.__setitem__("excluded", excluded), **changes)
    assert main(["build", str(copy), "--locked", "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{pin.pin_path(copy, 'tiny-bounds')}: excluded" in err and says in err
    assert not (tuned[0] / "model_repository" / "bounds_fp8").exists()


def test_the_console_counts_pinned_gemms_not_patterns(tuned, tiny_export, capsys):
    """C78: one pattern (``*mlp*``) read "1 GEMMs in high precision"."""
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    copy = _pinned_copy(tuned, tiny_export, "count", lambda d: d.__setitem__("excluded", ["*mlp*"]))
    res = run_pipeline(load_recipe(copy), copy, quiet=False, only=["export", "quantize"])
    out = " ".join("".join(capsys.readouterr()).split())
    assert "(6 of 14 GEMMs in high precision, 6 of them by the pin; no calibration, no search)" in out
    assert len(res.artifacts["quantize"].excluded_nodes) == 6
    assert res.artifacts["quantize"].calibration["tuning"]["excluded"] == 6


def test_a_pin_whose_tensors_feed_other_gemms_is_refused(tuned, tiny_export, capsys):
    """An exporter that renumbers its tensors (``mul_107``) would put every pinned scale on another
    tensor while the pin still matches: its ``consumers`` no longer agree with the exported graph's."""
    def swap(d):
        a, b = sorted(d["consumers"])[:2]
        d["consumers"][a], d["consumers"][b] = d["consumers"][b], d["consumers"][a]

    copy = _pinned_copy(tuned, tiny_export, "moved", swap)
    assert main(["build", str(copy), "--locked", "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{pin.pin_path(copy, 'tiny-moved')}: consumers[" in err and "feeds" in err
    assert f"re-tune (python -m pipeline tune {copy})" in err


def test_a_pin_written_before_consumers_applies_the_same_scales_and_says_unchecked(tuned, tiny_export, capsys):
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    copy = _pinned_copy(tuned, tiny_export, "older", lambda d: d.pop("consumers"))
    res = run_pipeline(load_recipe(copy), copy, quiet=False, only=["export", "quantize"])
    out = " ".join("".join(capsys.readouterr()).split())
    assert "has no `consumers` (written before them)" in out and "unchecked" in out
    bound = _pinned_copy(tuned, tiny_export, "bound")
    same = run_pipeline(load_recipe(bound), bound, quiet=True, only=["export", "quantize"])
    assert Path(res.artifacts["quantize"].onnx_path).read_bytes() == Path(same.artifacts["quantize"].onnx_path).read_bytes()


def test_tune_refuses_a_set_the_pin_would_match_and_keeps_the_pin(tuned, capsys):
    """C79: the pin written under ``--set quantize.accuracy_budget.max=0.9`` matched that command line
    only, and ``build --locked`` of the recipe then exited 2 "stale"."""
    ws, path = tuned
    before = pin.pin_path(path, "tiny-llm").read_bytes()
    assert main(["tune", str(path), "--quiet", "--set", "quantize.accuracy_budget.max=0.9"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "tune: --set quantize.accuracy_budget.max changes what the pin matches" in err
    assert f"Edit {path} and run tune without these --set" in err
    assert pin.pin_path(path, "tiny-llm").read_bytes() == before
