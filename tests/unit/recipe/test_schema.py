from __future__ import annotations

import pytest
import yaml

from conftest import ROOT
from pipeline.errors import RecipeError
from pipeline.recipe.gates import kind_metrics
from pipeline.recipe.load import load_recipe

RECIPE = ROOT / "recipes" / "fp8-llm.yaml"


def _variant(tmp_path, mutate):
    data = yaml.safe_load(RECIPE.read_text())
    mutate(data)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_recipe_is_valid():
    r = load_recipe(RECIPE)
    assert r.quantize.precision == "fp8"
    ppl, kld = r.validate_.gates
    assert (ppl.label, ppl.metric, ppl.max, ppl.min) == ("max_relative_perplexity_increase",
                                                         "relative_perplexity_increase", 0.014, None)
    assert (kld.metric, kld.max) == ("kld_mean", 0.025)
    assert r.validate_.data.describe() == "built-in corpus lee_background, documents [220, 300)"
    assert r.quantize.calibration.data.describe() == "built-in corpus lee_background, documents [0, 200)"


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda d: d["quantize"].update(bogus=1), "quantize.bogus: unknown key"),
        (lambda d: d["quantize"]["calibration"].update(methd="max"), "quantize.calibration.methd: unknown key; did you "
         "mean 'method'? valid keys here: batch_size, data, method, min_samples, percentile, samples, seq_len"),
        (lambda d: d["build"]["profiles"][0].update(dimz={}), "build.profiles.0.dimz: unknown key; did you mean 'dims'?"),
        (lambda d: d.update(validat={}), "validat: unknown key; did you mean 'validate'? valid keys here: build,"),
        (lambda d: d["validate"].update(max_window=8), "validate.max_window: unknown key; did you mean "
         "'max_windows'? valid keys here: "),
        (lambda d: d["quantize"]["calibration"].update(method="minmax"), "quantize.calibration.method"),
        (lambda d: d["export"].update(opset="nineteen"), "export.opset"),
        (lambda d: d["build"]["profiles"][0]["dims"]["batch"].update(min=9), "need min <= opt <= max"),
        (lambda d: d["quantize"]["calibration"]["data"].update(split={"start": 250, "stop": 200}),
         "quantize.calibration.data.split: Value error, stop (200) must be greater than start (250)"),
        (lambda d: d["validate"]["data"].update(type="csv"), "validate.data: Input tag 'csv' found using 'type' does "
         "not match any of the expected tags: 'corpus', 'text', 'jsonl', 'pairs', 'images', 'npz'"),
        (lambda d: d["validate"]["gates"][0].update(min=0.0), "validate.gates.0: Value error, give exactly one bound"),
        (lambda d: d["quantize"]["calibration"].update(samples=2), "below min_samples"),
        (lambda d: d["quantize"].update(reduce_range=True), "quantize: Value error, reduce_range (7-bit INT8 weights) "
         "needs precision int8, not 'fp8'"),
        (lambda d: d["triton"]["instance_group"][0].update(kind="GPU"), "triton.instance_group.0.kind"),
        (lambda d: d["build"].update(profiles=[]), "build.profiles"),
        (lambda d: d["quantize"]["calibration"].update(seq_len=512), "quantize.calibration.seq_len: seq_len=512 lies outside the sequence range of every build profile"),
        (lambda d: d["quantize"]["calibration"].update(batch_size=16), "quantize.calibration.batch_size: batch_size=16 lies outside the batch range of every build profile"),
        (lambda d: d["validate"].update(seq_len=512), "validate.seq_len: seq_len=512 lies outside the sequence range of "
         "every build profile ('default' [1, 256]); validate on shapes the engine will serve"),
        (lambda d: d["validate"].update(batch_size=16), "validate.batch_size: batch_size=16 lies outside the batch range"),
        (lambda d: d["validate"]["generation"].update(new_tokens=754), "validate.generation.new_tokens: new_tokens=754: "
         "greedy generation reaches a context of at least 769 tokens (16-token prompts, plus the tokenizer's special "
         "tokens, then 753 decode steps), beyond the total_sequence range of every build profile ('default' max 768)"),
    ],
)
def test_bad_recipe_names_file_and_key(tmp_path, mutate, expect):
    path = _variant(tmp_path, mutate)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(path) in str(err.value) and expect in str(err.value)


def test_unknown_key_set_under_an_aliased_section_gets_the_closest_key():
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPE, {"validate.max_window": 8})
    assert ("validate.max_window: unknown key; did you mean 'max_windows'? valid keys here: " in str(err.value)
            and "[from --set validate.max_window]" in str(err.value))


def test_override_by_dotted_path():
    r = load_recipe(RECIPE, {"validate.gates.0.max": 0.5})
    assert r.validate_.gates[0].max == 0.5


def test_a_tilde_in_work_dir_and_output_dir_is_the_home_folder(tmp_path, monkeypatch):
    """As for model and data paths: ``~/x`` was a literal ``./~/x`` folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    path = _variant(tmp_path, lambda d: d.update(work_dir="~/work"))
    r = load_recipe(path, {"output_dir": "~/repo"})
    assert (r.work_dir, r.output_dir) == (str(tmp_path / "home" / "work"), str(tmp_path / "home" / "repo"))
    assert load_recipe(RECIPE).work_dir == "artifacts"  # a relative path stays as given


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "b.yaml").write_text("x: 1\n")
    (tmp_path / "a.yaml").write_text("x: 1\n")
    with pytest.raises(RecipeError, match=rf"nope.yaml: recipe file not found; recipes in {tmp_path}/: a.yaml, b.yaml$"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(tmp_path / "list.yaml")


# --- YAML: duplicate keys and line numbers ------------------------------------------------

@pytest.mark.parametrize(
    "old, new, where",
    [
        ("    nodes: []", "    nodes: []\n    nodes: []", "'quantize.exclude.nodes'"),
        ("    - {metric: relative_perplexity_increase, max: 0.014}",
         "    - {metric: relative_perplexity_increase, max: 0.014, max: 9}", "'validate.gates.0.max'"),
        ("name: fp8-llm", "name: fp8-llm\nname: other", "'name'"),
        ("        batch:          {min: 1, opt: 4,   max: 8}",
         "        batch:          {min: 1, opt: 4,   max: 8, max: 16}", "'build.profiles.0.dims.batch.max'"),
    ],
)
def test_duplicate_key_is_refused_naming_path_and_both_lines(tmp_path, old, new, where):
    text = RECIPE.read_text()
    assert old in text
    path = tmp_path / "dup.yaml"
    path.write_text(text.replace(old, new, 1))
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(old))
    second = first + new.count("\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(path) in str(err.value) and where in str(err.value)
    assert f"given twice, at lines {first} and {second}" in str(err.value)


def test_every_duplicate_key_is_named_in_one_error(tmp_path):
    """All of them at once, not the first one per run."""
    text = RECIPE.read_text()
    lines = text.splitlines()
    path = tmp_path / "dups.yaml"
    path.write_text(text.replace("name: fp8-llm", "name: fp8-llm\nname: a\nname: b", 1)
                    .replace("    nodes: []", "    nodes: []\n    nodes: []", 1))
    name_line = next(i for i, line in enumerate(lines, 1) if line.startswith("name: fp8-llm"))
    nodes_line = next(i for i, line in enumerate(lines, 1) if line.startswith("    nodes: []")) + 2
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    message = str(err.value)
    assert f"{path}: 2 keys are given more than once" in message
    assert f"key 'name' is given 3 times, at lines {name_line}, {name_line + 1} and {name_line + 2}" in message
    assert f"key 'quantize.exclude.nodes' is given twice, at lines {nodes_line} and {nodes_line + 1}" in message
    assert message.index("'name'") < message.index("'quantize.exclude.nodes'")  # in the file's order


@pytest.mark.parametrize("text, where", [("name: [a, b\nmodel: {}\n", "line 2, column 6"),
                                         ("name: \x07\n", "position 6")])
def test_a_yaml_syntax_error_names_the_file_at_every_mark(tmp_path, text, where):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    message = str(err.value)
    assert message.startswith(f"{path}: not valid YAML") and f'in "{path}", {where}' in message
    assert "<unicode string>" not in message


def test_a_tag_its_value_does_not_fit_is_a_recipe_error(tmp_path):
    path = tmp_path / "tagged.yaml"
    path.write_text("name: !!int x\n")
    with pytest.raises(RecipeError, match=rf"^{path}: not valid YAML: invalid literal for int"):
        load_recipe(path)


def test_an_alias_inside_itself_and_an_alias_bomb_are_recipe_errors(tmp_path):
    path = tmp_path / "alias.yaml"
    path.write_text("name: x\nlist: &x [1, *x]\n")
    with pytest.raises(RecipeError, match=rf"^{path}: line 2: an alias refers to a value that contains it"):
        load_recipe(path)
    rows = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10**9 values
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(RecipeError, match=rf"^{path}: its aliases expand to more than 100,000 values"):
        load_recipe(path)
    for depth in (80, 2000):  # past the limit; past Python's recursion limit in PyYAML's composer
        path.write_text("x: " + "[" * depth + "]" * depth + "\n")
        with pytest.raises(RecipeError, match=rf"^{path}: (line 1: )?nested deeper than a recipe can be"):
            load_recipe(path)
    path.write_text("a: &d {max: 8}\nb: *d\n")  # an ordinary alias still reads (then the schema speaks)
    with pytest.raises(RecipeError, match="invalid recipe"):
        load_recipe(path)


def test_schema_error_gives_the_yaml_line(tmp_path):
    text = RECIPE.read_text().replace("    method: max", "    method: minmax", 1)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    line = text.splitlines().index("    method: minmax") + 1
    with pytest.raises(RecipeError, match=rf"{path}:{line}: quantize.calibration.method: Input should be"):
        load_recipe(path)


def test_constraint_error_gives_the_yaml_line(tmp_path):
    text = RECIPE.read_text().replace("  max_batch_size: 8", "  max_batch_size: 16", 1)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    line = text.splitlines().index("  max_batch_size: 16") + 1
    with pytest.raises(RecipeError, match=rf"{path}:{line}: triton.max_batch_size: 16 is greater than the max "
                                          r"batch 8 of build.profiles\[0\] \('default'\)"):
        load_recipe(path)


# --- --set overrides ------------------------------------------------------------------------

def test_override_list_index_and_new_value():
    r = load_recipe(RECIPE, {"build.profiles.0.dims.batch.max": 16, "triton.max_batch_size": 16})
    assert r.build.profiles[0].dims["batch"].max == 16 and r.triton.max_batch_size == 16


@pytest.mark.parametrize(
    "key, expect",
    [
        ("build.profiles.1.dims.batch.max", "--set build.profiles.1.dims.batch.max: build.profiles is a list of 1 item"),
        ("build.profiles.first.name", "'first' is not an index in 0..0"),
        ("build.timing_cache.path", "--set build.timing_cache.path: build.timing_cache is '.cache/trt/fp8-llm"),
        ("validate..gates", "empty key part"),
    ],
)
def test_override_path_errors_name_the_set_key(key, expect):
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPE, {key: 1})
    assert expect in str(err.value)


def test_override_schema_error_names_the_set():
    with pytest.raises(RecipeError, match=r"quantize.exclude.nodes: Input should be a valid list \(got '\*mlp\*'\) "
                                          r"\[from --set quantize.exclude.nodes\]"):
        load_recipe(RECIPE, {"quantize.exclude.nodes": "*mlp*"})


# --- pre-flight constraints: one per constraint ------------------------------------------------

def _profile(name="default", batch=(1, 4, 8), sequence=(1, 64, 256), past=(0, 64, 512), total=(1, 128, 768)):
    dims = {"batch": batch, "sequence": sequence, "past_sequence": past, "total_sequence": total}
    return {"name": name, "dims": {k: dict(zip(("min", "opt", "max"), v)) for k, v in dims.items() if v}}


@pytest.mark.parametrize(
    "mutate, expect",
    [
        # max_batch_size against every profile, not only profiles[0]
        (lambda d: d["build"].update(profiles=[_profile(), _profile("decode", batch=(1, 2, 4), sequence=(1, 1, 1))]),
         "triton.max_batch_size: 8 is greater than the max batch 4 of build.profiles[1] ('decode')"),
        (lambda d: d["build"]["profiles"][0].update(inputs={"input_ids": {"min": [1, 1], "opt": [2, 8], "max": [4, 16]}}),
         "triton.max_batch_size: 8 is greater than the max batch 4 of build.profiles[0]"),
        (lambda d: d["triton"].update(generate_model_name="smollm2_fp8"),
         "triton.generate_model_name: 'smollm2_fp8' is also triton.model_name"),
        # calibration shapes: in no profile at all, or in no single profile together
        (lambda d: d["build"].update(profiles=[_profile("decode", sequence=(1, 1, 1), total=(1, 257, 513)),
                                                _profile("prefill", batch=(1, 1, 2))]),
         "quantize.calibration: batch_size=4, seq_len=128, past_sequence (empty past)=0, total_sequence (= seq_len)=128 "
         "fit no single build profile together"),
        (lambda d: d["build"].update(profiles=[_profile(past=(1, 64, 512))]),
         "past_sequence (empty past)=0 lies outside the past_sequence range of every build profile ('default' [1, 512])"),
        (lambda d: d["triton"].update(target="tensorrt", instance_group=[{"count": 1, "kind": "KIND_CPU"}]),
         "triton.instance_group.0.kind: KIND_CPU cannot run a tensorrt_plan"),
        (lambda d: d["triton"].update(target="python-onnxruntime", instance_group=[{"kind": "KIND_GPU"}]),
         "triton.instance_group.0.kind: KIND_GPU on target 'python-onnxruntime'"),
        (lambda d: d["triton"].update(dynamic_batching={"preferred_batch_size": [4, 16]}),
         "triton.dynamic_batching.preferred_batch_size.1: 16 is outside 1..max_batch_size (8)"),
        (lambda d: d["validate"]["gates"].append({"metric": "mean_cosine", "min": 0.99}),
         "validate.gates.2.metric: 'mean_cosine' is not a metric of a text-generation model; valid: "
         f"{sorted(kind_metrics('text-generation'))}"),
        (lambda d: (d["validate"]["gates"].append({"metric": "token_agreement", "min": 0.9}),
                    d["validate"].pop("generation")),
         "validate.gates.2.metric: token_agreement is measured by greedy generation: add validate.generation"),
        (lambda d: d["validate"]["gates"].append({"metric": "relative_perplexity_increase", "max": 0.1}),
         "validate.gates.2: gate name 'max_relative_perplexity_increase' is also the name of gate 0"),
        (lambda d: d["validate"].update(data={"type": "corpus", "name": "wordsim353"}),
         "validate.data.type: built-in corpus wordsim353, word pairs [0, end) gives pairs; a text-generation model "
         "reads texts here: a corpus (lee_background), text or jsonl source"),
        (lambda d: d["export"]["check_points"][1].update(beam=2),
         "export.check_points.1.beam: 'beam' is not a dynamic dim of the graph"),
        (lambda d: d["export"]["check_points"][0].pop("past_sequence"),
         "export.check_points.0: point {'batch': 1, 'sequence': 16} lacks ['past_sequence']"),
        (lambda d: d["export"]["check_points"][2].update(total_sequence=99),
         "export.check_points.2.total_sequence: total_sequence=99 must equal sequence + past_sequence (40 + 37)"),
        (lambda d: d["export"]["check_points"][2].update(batch=0), "export.check_points.2.batch: size 0 is below 1"),
        (lambda d: d["export"].update(check_points=d["export"]["check_points"][:2]),
         "export.check_points: give at least 3 shape points"),
        (lambda d: d["build"]["profiles"][0]["dims"].update(beams={"min": 1, "opt": 1, "max": 2}),
         "build.profiles.0.dims.beams: no graph input has the dynamic dim 'beams'"),
        (lambda d: d["build"].update(profiles=[_profile(), _profile()]),
         "build.profiles.1.name: 'default' is also the name of profile 0"),
        (lambda d: d["export"]["dynamic_axes"].update(token_type_ids={0: "batch", 1: "sequence"}),
         "export.dynamic_axes.token_type_ids: a text-generation graph has no input 'token_type_ids'"),
        (lambda d: d["export"]["dynamic_axes"]["input_ids"].update({2: "x"}),
         "export.dynamic_axes.input_ids.2: input_ids has rank 2: axis 2 does not exist"),
        (lambda d: d["export"]["dynamic_axes"]["attention_mask"].update({0: "rows"}),
         "export.dynamic_axes: axis 0 is one batch dim shared by every input; got the names ['batch', 'rows']"),
        (lambda d: d["export"]["dynamic_axes"]["attention_mask"].pop(0),
         "export.dynamic_axes.attention_mask: axis 0 of attention_mask is not dynamic"),
        (lambda d: d["export"]["dynamic_axes"].pop("input_ids"),
         "export.dynamic_axes: needs input_ids with a dynamic batch axis"),
    ],
)
def test_preflight_constraint(tmp_path, mutate, expect):
    path = _variant(tmp_path, mutate)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert expect in str(err.value)


def test_encoder_constraints(tmp_path):
    enc = ROOT / "recipes" / "int8-encoder.yaml"
    data = yaml.safe_load(enc.read_text())
    data["triton"].update(max_batch_size=0, dynamic_batching=None)
    data["validate"]["gates"].append({"metric": "relative_perplexity_increase", "max": 0.01})
    path = tmp_path / "enc.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert "validate.gates.2.metric: 'relative_perplexity_increase' is not a metric of a sentence-embedding model; " \
           "valid: ['mean_cosine', 'min_cosine', 'spearman_drop_max', 'spearman_drop_simlex999', " \
           "'spearman_drop_wordsim353', 'speedup_vs_fp32']" in str(err.value)
    assert "triton.max_batch_size: an encoder's tokenizer model and ensemble batch requests" in str(err.value)


def test_all_constraint_problems_are_listed_at_once(tmp_path):
    path = _variant(tmp_path, lambda d: d["triton"].update(max_batch_size=16, generate_model_name="smollm2_fp8"))
    with pytest.raises(RecipeError, match=r"invalid recipe \(2 error\(s\)\)"):
        load_recipe(path)


def test_unquoted_container_tag_read_as_a_float_says_to_quote_it(tmp_path):
    text = (ROOT / "recipes" / "fp8-llm.yaml").read_text()
    path = tmp_path / "r.yaml"
    path.write_text(text.replace("triton:\n", "triton:\n  serving:\n    container: 24.10\n    gpu: H100\n", 1))
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert "triton.serving.container: Input should be a valid string (got 24.1); YAML reads the unquoted 24.10 " \
           "as the number 24.1: quote it, e.g. '24.10'" in str(err.value)
    with pytest.raises(RecipeError, match=r"--set reads its value as YAML, which reads an unquoted value as a number "
                                          r"\(24\.10 as 24\.1\): quote it inside the argument \[from --set triton.serving\]"):
        load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"triton.serving": {"container": 24.1, "gpu": "H100"}})


def test_a_number_set_where_a_string_is_wanted_quotes_the_set_value_not_the_files(capsys):
    """``--set name=123`` said to quote 'fp8-llm', the file's value there."""
    from pipeline.cli import app as cli

    assert cli.main(["check", str(RECIPE), "--set", "name=123"]) == 2
    err = capsys.readouterr().err
    assert "name: Input should be a valid string (got 123); --set reads its value as YAML, which reads an unquoted " \
           "123 as a number: quote it inside the argument, e.g. --set \"name='123'\" [from --set name]" in err, err
    assert "fp8-llm" not in err.split("name:", 1)[1]


def test_a_generic_recipe_with_a_hugging_face_folder_names_file_line_and_the_kinds(tmp_path):
    example = ROOT / "examples" / "custom-model" / "recipe.yaml"
    text = example.read_text()
    assert "source: {entry: ./model.py:make_model}" in text
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace("source: {entry: ./model.py:make_model}", "source: {path: ./hf-folder}"))
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "source:" in t)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert (f"{path}:{line}: model.source: a generic model comes from entry: ./my_model.py:make_model "
            "(returning (nn.Module, example inputs)) or onnx: ./model.onnx; got path ./hf-folder; a Hugging Face "
            "folder is kind: text-generation") in str(err.value)
    assert "kind: sentence-embedding" in str(err.value)


# --- rules check applies that the build or bench found only at the end ----------

def _gate(metric: str, **bound) -> dict:
    return {"metric": metric, "statistic": "evidence_of_regression", **bound}


@pytest.mark.parametrize("mutate, expect", [
    (lambda d: (d["validate"].update(max_windows=1),
                d["validate"]["gates"].append(_gate("kld_mean", max=0.03, name="kld_test"))),
     "validate.gates.2.statistic: evidence_of_regression needs the standard error of kld_mean, which resamples eval "
     "windows, and validate.max_windows is 1: one eval window has none, so the gate could only fail at the end of the "
     "build; valid: validate.max_windows >= 2"),
    (lambda d: (d["validate"].update(generation={"prompts": 1, "new_tokens": 32}),
                d["validate"]["gates"].append(_gate("token_agreement", min=0.5))),
     "validate.gates.2.statistic: evidence_of_regression needs the standard error of token_agreement, which resamples "
     "greedy prompts, and validate.generation.prompts is 1"),
    (lambda d: d["serve"].update(tpot_positions=[16, 500], long_max_tokens=504),
     "serve.tpot_positions.1: 500: TPOT there needs 504 generated tokens after a prompt of at least 16 tokens, a "
     "context of 519, and the generation stops at 513 (build.profiles 'default'); the largest position it reaches is "
     "494: valid: tpot_positions[1] <= 494"),
    (lambda d: d["build"]["profiles"][0]["dims"].update(past_sequence={"min": 0, "opt": 32, "max": 64},
                                                        total_sequence={"min": 1, "opt": 64, "max": 128}),
     "serve.tpot_positions.1: 256: TPOT there needs 260 generated tokens after a prompt of at least 16 tokens, a "
     "context of 275, and the generation stops at 65 (build.profiles 'default'); the largest position it reaches "
     "is 46: valid: tpot_positions[1] <= 46"),
], ids=["one-window", "one-prompt", "tpot-past-context", "short-profile"])
def test_check_refuses_what_the_build_or_bench_found_only_at_the_end(tmp_path, mutate, expect):
    path = _variant(tmp_path, mutate)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert expect in str(err.value)


def test_the_limits_themselves_pass(tmp_path):
    """Two windows / prompts, a point gate on one window, and the largest reachable position are valid."""
    load_recipe(_variant(tmp_path, lambda d: (d["validate"].update(max_windows=2, generation={"prompts": 2, "new_tokens": 8}),
                                              d["validate"]["gates"].append(_gate("kld_mean", max=0.03, name="k")),
                                              d["validate"]["gates"].append(_gate("token_agreement", min=0.5)))))
    load_recipe(_variant(tmp_path, lambda d: d["validate"].update(max_windows=1)))
    load_recipe(_variant(tmp_path, lambda d: d["serve"].update(tpot_positions=[16, 494], long_max_tokens=498)))


def test_a_one_sentence_encoder_gate_and_a_one_image_split_are_refused(tmp_path):
    enc = yaml.safe_load((ROOT / "recipes" / "int8-encoder.yaml").read_text())
    enc["validate"]["max_windows"] = 1
    enc["validate"]["gates"].append(_gate("mean_cosine", min=0.99))
    enc["validate"]["gates"].append(_gate("spearman_drop_max", max=5.0))  # word pairs: the data decides
    (tmp_path / "enc.yaml").write_text(yaml.safe_dump(enc))
    with pytest.raises(RecipeError) as err:
        load_recipe(tmp_path / "enc.yaml")
    assert "resamples held-out sentences, and validate.max_windows is 1" in str(err.value)
    assert "spearman_drop_max" not in str(err.value)
    img = yaml.safe_load((ROOT / "recipes" / "int8-textline-orientation.yaml").read_text())
    img["validate"]["data"]["split"] = {"start": 3, "stop": 4}
    img["validate"]["gates"] = [_gate("top1_agreement", min=0.9)]
    (tmp_path / "img.yaml").write_text(yaml.safe_dump(img))
    with pytest.raises(RecipeError, match=r"resamples eval images, and validate.data.split is 1"):
        load_recipe(tmp_path / "img.yaml")


def test_the_slo_gate_fields_at_their_defaults_keep_the_digest(tmp_path):
    """serve is no part of the digest: a recipe with the gate on hashes as the shipped one."""
    shipped = load_recipe(RECIPE)
    gated = load_recipe(RECIPE, {"serve.slo.gate": True, "serve.slo.min_met": 0.5})
    assert gated.serve.slo.gate and gated.serve.slo.min_met == 0.5 and gated.digest == shipped.digest
    assert not shipped.serve.slo.gate and "gate" not in yaml.safe_load(RECIPE.read_text())["serve"]["slo"]
    with pytest.raises(RecipeError, match=r"min_met applies to the SLO gate only; add gate: true, or drop min_met"):
        load_recipe(RECIPE, {"serve.slo.min_met": 0.5})
