"""The text-generation adapter (:class:`pipeline.models.base.ModelAdapter`): a causal LM
exported with its KV cache as graph I/O, measured by perplexity and greedy agreement,
served by a decoupled generation model."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from pipeline.artifacts import TensorSpec
from pipeline.errors import ExportError
from pipeline.checks.export import quiet_export
from pipeline.models.base import BenchWorkload, LoadedModel
from pipeline.models.common import OnnxRuntimeRunners, SourceFiles, text_batches as _text_batches
from pipeline.models.text_generation.kv import LAST_LOGITS, KVLayout
from pipeline.sources.model import ModelFileError
from pipeline.models.text_generation.model import (
    KVCacheLM, PositionTable, check_model_folder, complete_point, kv_layout, sliding_window, load_causal_lm,
    package_file, position_table, prefill_feeds, sample_feeds, save_tokenizer,
)
from pipeline.recipe.schema import ModelSource
from pipeline.recipe.checks import total_dim
from pipeline.recipe.kinds import KV_PAST_RE, PAST_DIM
from pipeline.sources.model import load_tokenizer

DIM_MAX = 8192  # the exported graph's largest sequence / batch size
LEFT_PAD = 2  # masked leading positions of the left-padded row at export check points


class TextGenerationAdapter(OnnxRuntimeRunners, SourceFiles):
    """A causal LM with its KV cache as graph I/O (``model.kind: text-generation``).

    One instance serves one run: :meth:`load` records the KV layout that the
    export members (:meth:`dynamic_axes`, :meth:`export`, :meth:`sample_feeds`)
    then read; everything after export reads the layout back from the graph.
    """

    kind: ClassVar[str] = "text-generation"

    def __init__(self, source: ModelSource | None):
        self.source = source
        self.layout: KVLayout | None = None

    def check_files(self) -> None:
        """A loadable fast tokenizer and an EOS id (:func:`check_model_folder`).

        Raises:
            ModelFileError: names the folder and the missing files.
        """
        check_model_folder(self.source)

    def check_recipe(self, recipe) -> list[str]:
        """The build profiles against the model's position table (:func:`check_positions`).

        Raises:
            ModelFileError: learned positions, and a profile that reaches past their table (exit 2).
        """
        return check_positions(position_table(self.source), recipe)

    def save_processor(self, loaded: LoadedModel, folder: Path) -> None:
        """The tokenizer and the model's generation config (its EOS set): :func:`save_tokenizer`."""
        save_tokenizer(loaded.processor, loaded.module.model.generation_config, folder)

    def load(self, ctx) -> LoadedModel:
        """The FP32 model wrapped as :class:`KVCacheLM`, its tokenizer and the export example
        (:data:`EXAMPLE` sizes).

        Raises:
            ExportError: the package or file is missing.
            ModelFileError: the folder lacks tokenizer files or an EOS id (:meth:`check_files`).
        """
        self.check_files()
        for warning in self.check_recipe(ctx.recipe):
            ctx.progress.print(f"[yellow]warning: {warning}[/yellow]")
        with ctx.progress.step(f"load {package_file(self.source)}"):
            model, tok = load_causal_lm(self.source)
        self.layout = kv_layout(model)
        check_window(model, ctx.recipe.build.profiles, total_dim(ctx.recipe))
        module = KVCacheLM(model, self.layout).eval()
        names = ("input_ids", "attention_mask", *self.layout.past_names())
        return LoadedModel(module, tok, sample_feeds(self.layout, **EXAMPLE), names,
                           tuple(module.output_names()))

    def graph_io(self, loaded: LoadedModel, export_cfg) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Inputs ``input_ids`` / ``attention_mask`` int64, the past float32; outputs ``logits``,
        the presents and ``last_logits`` (dims named by :meth:`dynamic_axes`; see ``kv``)."""
        layout, axes = self.layout, self.dynamic_axes(export_cfg)

        def shape(name: str, rank: int, fixed: dict[int, int]) -> list[int | str]:
            return [axes.get(name, {}).get(a, fixed.get(a, -1)) for a in range(rank)]

        kv = {1: layout.kv_heads, 3: layout.head_dim}
        ins = [TensorSpec("input_ids", "int64", shape("input_ids", 2, {})),
               TensorSpec("attention_mask", "int64", shape("attention_mask", 2, {}))]
        ins += [TensorSpec(n, "float32", shape(n, 4, kv)) for n in layout.past_names()]
        batch, seq = ins[0].shape
        outs = [TensorSpec("logits", "float32", [batch, seq, layout.vocab])]
        outs += [TensorSpec(n, "float32", [batch, layout.kv_heads, -1, layout.head_dim]) for n in layout.present_names()]
        return ins, outs + [TensorSpec(LAST_LOGITS, "float32", [batch, layout.vocab])]

    def dynamic_axes(self, export_cfg) -> dict[str, dict[int, str]]:
        """Recipe axes plus ``{0: batch, 2: past_sequence}`` on every past input."""
        axes = {k: dict(v) for k, v in export_cfg.dynamic_axes.items()}
        batch = axes["input_ids"][0]
        for name in self.layout.past_names():
            axes.setdefault(name, {0: batch, 2: "past_sequence"})
        return axes

    def export(self, module: KVCacheLM, export_cfg, out: Path) -> None:
        """torch.onnx.export(dynamo=True) with named dynamic dims.

        Raises:
            ExportError: the exporter failed; its message is kept.
        """
        layout = self.layout
        axes = self.dynamic_axes(export_cfg)
        dims: dict[str, torch.export.Dim] = {}

        past_max = past_size_max(module.model)

        def dim(name: str):
            past = "past" in name
            return dims.setdefault(name, torch.export.Dim(name, min=0 if past else 1,
                                                          max=past_max if past else DIM_MAX))

        names = ["input_ids", "attention_mask", *layout.past_names()]
        shapes = {"input_ids": {a: dim(d) for a, d in axes["input_ids"].items()},
                  "attention_mask": {a: dim(d) for a, d in axes["attention_mask"].items()},
                  "past": tuple({a: dim(d) for a, d in axes[n].items()} for n in layout.past_names())}
        feeds = sample_feeds(layout, **EXAMPLE)
        args = tuple(torch.from_numpy(feeds[n]) for n in names)
        try:
            with quiet_export():
                torch.onnx.export(
                    module, args, str(out), dynamo=True, dynamic_shapes=shapes, input_names=names,
                    output_names=module.output_names(), opset_version=export_cfg.opset,
                    external_data=True, verbose=False,  # weights beside it: ~3 GB lower peak RSS
                )
        except Exception as e:  # the exporter raises many types; keep its text
            raise ExportError(f"export: torch.onnx.export failed: {type(e).__name__}: {e}") from e

    def sample_feeds(self, module, inputs, point: dict[str, int], seed: int) -> dict[str, np.ndarray]:
        """Random feeds at ``point`` (``batch``, ``sequence``, ``past_sequence``); at batch >= 2
        row 0 is left-padded by :data:`LEFT_PAD` positions (as batched generation pads prompts),
        so the check compares positions derived from the mask with torch."""
        p = complete_point(point)
        return sample_feeds(self.layout, p["batch"], p["sequence"], p["past_sequence"], seed, left_pad=LEFT_PAD)

    def calibration_feeds(self, exp, data, cal) -> list[dict[str, np.ndarray]]:
        """Prefill batches of real text: ``cal.samples`` windows int64 ``[<=cal.batch_size,
        cal.seq_len]`` of the documents of ``data`` (:func:`pipeline.models.text.token_windows`),
        each with an all-ones mask and an empty past."""
        return _text_batches(exp, data, cal, prefill_feeds)

    def metrics(self, ctx, exp, q, engine=None) -> tuple[dict, dict]:
        """:func:`pipeline.models.text_generation.metrics.llm_metrics` of :meth:`candidate_runner`
        against :meth:`reference_runner`: perplexity, greedy agreement and the tokens."""
        from pipeline.models.text_generation.metrics import llm_metrics

        return llm_metrics(ctx, exp, q, engine, self.reference_runner(exp), self.candidate_runner(q))

    def triton_models(self, recipe, export, compute, build, staging: Path) -> list:
        """The decoupled generation model (tokenizer, KV cache through the compute model),
        when the recipe names ``triton.generate_model_name``; for a KV-cache graph also
        ``<work_dir>/<recipe>/triton/deploy_notes.md`` (its shared-memory size)."""
        from pipeline.models.text_generation import triton

        if any(KV_PAST_RE.match(s.name) for s in compute.inputs):
            triton.write_deploy_notes(recipe, compute.inputs, compute.outputs, build.profiles)
        if not recipe.triton.generate_model_name:
            return []
        return [triton.stage_generate(recipe, export, compute.inputs, build, staging)]

    def served_models(self, recipe) -> list[str]:
        """``[triton.generate_model_name]`` when set, else ``[]``."""
        return [recipe.triton.generate_model_name] if recipe.triton.generate_model_name else []

    def front_model(self, recipe) -> str | None:
        """The generation model (None: the recipe serves the compute model alone)."""
        return recipe.triton.generate_model_name or None

    def bench_workload(self, recipe, tokenizer_dir: str) -> BenchWorkload:
        """Streamed generations of validate's prompts (:func:`validate_prompts`, as served token
        ids: ``input_ids`` int64 ``[n]``) through the generation model."""
        prompts = validate_prompts(recipe.validate_, tokenizer_dir)
        requests = [{"input_ids": np.asarray(p, np.int64)} for p in prompts]
        return BenchWorkload(str(recipe.triton.generate_model_name), True, requests,
                             f"{len(prompts)} validate prompts")

    def torch_outputs(self, module: KVCacheLM, feeds: dict[str, np.ndarray]):
        """``(logits, *present, last_logits)`` torch tensors on ``feeds``."""
        names = ["input_ids", "attention_mask", *self.layout.past_names()]
        return module(*(torch.from_numpy(feeds[n]) for n in names))


#: the export's example feed sizes: above 1 and distinct, so the exporter specialises no dim
EXAMPLE = {"batch": 2, "sequence": 5, "past": 3}


def past_size_max(model) -> int:
    """The past's largest size: ``total_sequence - 1`` (a step adds >= 1 position), below a
    sliding window's ``window - 1``. Declared as the traced graph guards it, the exporter
    traces once instead of failing its range check and tracing again."""
    return min(DIM_MAX, sliding_window(model) or DIM_MAX) - 1


def check_window(model, build_profiles, total_name: str | None = None) -> None:
    """A sliding-window cache layer keeps ``window - 1`` positions, so ``present`` is not
    ``past + sequence`` beyond that: every profile's max of ``total_name`` (the attention mask's axis 1,
    ``total_sequence`` unless the recipe renames it) must stay within it.

    Raises:
        ExportError: names the window, the profile and its ``total_name`` max; or a window
            too small for the export's example past (:data:`EXAMPLE`).
    """
    window, total_name = sliding_window(model), total_name or "total_sequence"
    if window is not None and window - 1 < EXAMPLE["past"]:
        raise ExportError(f"{type(model).__name__}: a sliding window of {window} tokens keeps {window - 1} past "
                          f"positions; the export traces with a {EXAMPLE['past']}-position past, so windows below "
                          f"{EXAMPLE['past'] + 1} tokens are not supported")
    for prof in build_profiles if window else []:
        total = prof.dims.get(total_name)
        if total is not None and total.max > window - 1:
            raise ExportError(
                f"build.profiles {prof.name!r}: {total_name} max {total.max} exceeds what the sliding-window "
                f"cache layers of {type(model).__name__} keep ({window - 1} positions of a {window}-token window); "
                f"lower {total_name} max to <= {window - 1} (and past_sequence / sequence with it)")


def profile_positions(recipe) -> list[tuple[str, int, str]]:
    """Per build profile that bounds it: ``(name, the most positions one sequence reaches, how)``:
    the attention mask's axis-1 max (``total_sequence``), or past max + sequence max when lower
    (or alone), or an explicit ``attention_mask`` shape's max."""
    total = total_dim(recipe) or "total_sequence"
    seq = recipe.export.dynamic_axes.get("input_ids", {}).get(1, "sequence")
    out = []
    for prof in recipe.build.profiles:
        ways: dict[str, int] = {}
        if total in prof.dims:
            ways[f"{total} max {prof.dims[total].max}"] = prof.dims[total].max
        if PAST_DIM in prof.dims and seq in prof.dims:
            n = prof.dims[PAST_DIM].max + prof.dims[seq].max
            ways[f"{PAST_DIM} max {prof.dims[PAST_DIM].max} + {seq} max {prof.dims[seq].max}"] = n
        mask = prof.inputs.get("attention_mask")
        if mask is not None and mask.max:
            ways[f"attention_mask max {mask.max}"] = mask.max[-1]
        if ways:
            how = min(ways, key=lambda k: ways[k])
            out.append((prof.name, ways[how], how))
    return out


def check_positions(table: PositionTable | None, recipe) -> list[str]:
    """Positions the profiles reach (:func:`profile_positions`) against the model's table: past a
    *learned* table no position exists (refused); past a *rotary* one positions were not trained
    (a warning: the generation model serves min(profile context, table) tokens unless
    ``triton.allow_context_beyond_max_positions``). Returns the warnings.

    Raises:
        ModelFileError: learned positions and a profile past their table, naming both numbers (exit 2).
    """
    if table is None or table.kind == "none" or table.size is None:
        return []
    size = table.size
    over = [(name, n, how) for name, n, how in profile_positions(recipe) if n > size]
    if not over:
        return []
    total = total_dim(recipe) or "total_sequence"
    shown = "; ".join(f"build.profiles {name!r} reaches {n} positions ({how})" for name, n, how in over)
    if table.kind == "learned":
        raise ModelFileError(
            f"{shown}, but {table.model} learns a table of {size} positions (config.json {table.key} {size}): no "
            f"position past {size - 1} exists, so a longer sequence fails (or is cut) when served. Lower {total} max "
            f"(and {PAST_DIM} / sequence max with it) to at most {size}")
    if recipe.triton.allow_context_beyond_max_positions:
        served = "triton.allow_context_beyond_max_positions is true: the generation model serves the profiles' context"
    else:
        served = (f"the generation model serves at most {size} tokens of context (min(profile context, {table.key}); "
                  "triton.allow_context_beyond_max_positions: true serves the profiles' whole context)")
    return [f"{shown}, past {table.model}'s {table.key} {size}: its rotary positions were not trained beyond "
            f"{size - 1}, so quality there is unknown; {served}"]


BENCH_PROMPTS = 8  # prompts when the recipe has no validate.generation


def validate_prompts(validate_cfg, tokenizer_dir: str) -> list[list[int]]:
    """The held-out prompts (token ids, as the served model tokenizes them) of ``validate``:
    the one choice shared by validate's greedy check, ``serve --check`` and the bench;
    ``validate.generation.prompts`` of them (8 without generation).

    Raises:
        DataError: the split reaches past the corpus.
    """
    from pipeline.models import text as text_data

    count = validate_cfg.generation.prompts if validate_cfg.generation else BENCH_PROMPTS
    docs = text_data.documents(validate_cfg.data)
    return text_data.prompts(load_tokenizer(tokenizer_dir), docs, count).tolist()
