"""Triton models of the text-generation kind: the decoupled generation model
(:mod:`pipeline.models.text_generation.served`: tokenizer, prefill and decode with the KV cache
through the compute model) and the deploy notes that size its shared memory.
Written into the staging folder of :func:`pipeline.stages.triton.write_repository`,
which checks and publishes them."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pipeline.artifacts import BuildArtifact, ExportArtifact, ResolvedProfile, TensorSpec
from pipeline.errors import TritonConfigError
from pipeline.models.text_generation import kv as _kv
from pipeline.models.text_generation.kv import KVLayout
from pipeline.recipe.schema import Recipe
from pipeline.triton.config import GENERATE_INPUTS, GENERATE_OUTPUTS, generate_config, parse_config
from pipeline.sources.model import load_tokenizer
from pipeline.triton.repository import (
    StagedModel,
    context_limits,
    copy_tokenizer,
    eos_token_ids,
    write_config,
)

DEFAULT_MAX_TOKENS = 32  # generation default when the recipe has no validate.generation


DEPLOY_NOTES = "deploy_notes.md"
DOCKER_DEFAULT_SHM = 64 << 20  # bytes of /dev/shm under a plain `docker run`
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def shm_bytes(kv: KVLayout, batch: int, context: int, vocab: int) -> dict[str, int]:
    """Shared memory (bytes) the python backend needs at the worst generation step.

    The KV cache of ``batch`` sequences of ``context`` tokens is
    ``2 (K, V) x B x S x L x H_kv x D x bytes``; one step holds it twice (the
    past it sends, the present it receives), plus ``last_logits`` float32
    ``[B, V]``. ``total`` adds 25 % headroom for Triton's own tensors.
    """
    cache = 2 * batch * context * kv.num_layers * kv.kv_heads * kv.head_dim * _DTYPE_BYTES.get(kv.dtype, 4)
    logits = batch * vocab * 4
    need = 2 * cache + logits
    return {"kv_cache": cache, "last_logits": logits, "step": need, "total": need + need // 4}


SHM_STEP_MIB = 64  # --shm-size and the /dev/shm emptyDir are rounded up to this (Docker's default size)


@dataclass(frozen=True)
class ShmSize:
    """The /dev/shm a KV-cache repository needs: ``mib`` (Docker's ``--shm-size``, the
    Kubernetes emptyDir's ``sizeLimit``) and what it was sized from (:func:`shm_bytes`)."""

    mib: int
    need: dict[str, int]
    kv: KVLayout
    batch: int
    context: int
    vocab: int

    def how(self) -> str:
        """One line: the formula with its numbers."""
        return (f"{self.batch} sequences x {self.context} tokens: KV cache {self.need['kv_cache'] / 2**20:.1f} MiB "
                f"in and out, plus last_logits, plus 25 % = {self.need['total'] / 2**20:.1f} MiB, rounded up to "
                f"{SHM_STEP_MIB} MiB")


def shm_size(recipe: Recipe, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
             profiles: Sequence[ResolvedProfile]) -> ShmSize:
    """The repository's /dev/shm: :func:`shm_bytes` at ``triton.max_batch_size`` sequences of the
    profiles' max context (:func:`pipeline.triton.repository.context_limits`; 2048 tokens when
    none bounds it), rounded up to 64 MiB. One number for the deploy notes and ``deploy k8s``.

    Raises:
        PipelineError: ``inputs`` hold no complete KV cache (:func:`pipeline.models.text_generation.kv.kv_layout`).
    """
    kv = kv_layout(inputs)
    vocab = next((int(s.shape[-1]) for s in outputs if s.name == "logits" and isinstance(s.shape[-1], int)), 0)
    batch = max(1, recipe.triton.max_batch_size)
    context = context_limits(profiles)["max_context"] or DEFAULT_SHM_CONTEXT
    need = shm_bytes(kv, batch, context, vocab)
    step = SHM_STEP_MIB << 20
    return ShmSize(max(1, -(-need["total"] // step)) * SHM_STEP_MIB, need, kv, batch, context, vocab)


def write_deploy_notes(recipe: Recipe, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                       profiles: Sequence[ResolvedProfile]) -> Path:
    """``<work_dir>/<recipe>/triton/deploy_notes.md``: the ``--shm-size`` the repository needs
    (:func:`shm_size`). Outside the model folders, so it is not part of their published hashes.
    Returns its path."""
    size = shm_size(recipe, inputs, outputs, profiles)
    kv, need, batch, context, vocab = size.kv, size.need, size.batch, size.context, size.vocab
    mib = lambda n: f"{n / (1 << 20):.1f} MiB"  # noqa: E731
    text = (
        f"# Deploying {recipe.name}\n\n"
        f"Run Triton with `--shm-size={size.mib}m` (e.g. `docker run --gpus all --shm-size={size.mib}m ...`; "
        f"`deploy k8s` gives its /dev/shm the same {size.mib} MiB).\n\n"
        "The python-backend generation model moves the KV cache through /dev/shm at every step:\n\n"
        f"- KV cache: 2 x B {batch} x S {context} x L {kv.num_layers} x H_kv {kv.kv_heads} x D {kv.head_dim} "
        f"x {_DTYPE_BYTES.get(kv.dtype, 4)} bytes ({kv.dtype}) = {mib(need['kv_cache'])}\n"
        f"- one step holds it twice (past in, present out), plus `last_logits` [B {batch}, V {vocab}] float32 "
        f"= {mib(need['last_logits'])}: {mib(need['step'])}\n"
        f"- with 25 % headroom: {mib(need['total'])}, rounded up to {SHM_STEP_MIB} MiB; Docker's default /dev/shm "
        f"is 64 MiB" + (" (too small)" if need["total"] > DOCKER_DEFAULT_SHM else "") + ".\n\n"
        f"B is triton.max_batch_size (concurrent generations), S the max context of the optimization profiles. "
        f"Request `last_logits` ([batch, vocab]) rather than `logits` ([batch, sequence, vocab]) per step: a "
        f"{context}-token prefill's full logits alone are {mib(batch * context * vocab * 4)}.\n"
    )
    path = Path(recipe.work_dir) / recipe.name / "triton" / DEPLOY_NOTES
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


DEFAULT_SHM_CONTEXT = 2048  # tokens assumed when no profile bounds the context


def stage_generate(
    recipe: Recipe, export: ExportArtifact, graph_inputs: list[TensorSpec], build: BuildArtifact, staging: Path
) -> StagedModel:
    """Generation model: model.py template, tokenizer files and KV numbers in parameters."""
    kv = kv_layout(export.inputs)
    _check_kv(recipe.triton.model_name, kv, graph_inputs)
    name = str(recipe.triton.generate_model_name)
    version_dir = staging / name / str(recipe.triton.version)
    copy_tokenizer(Path(export.tokenizer_dir), version_dir)
    check_chat_template(version_dir)
    write_served(version_dir)
    generation = recipe.validate_.generation
    cfg = generate_config(
        name,
        compute_model=recipe.triton.model_name,
        num_layers=kv.num_layers,
        kv_heads=kv.kv_heads,
        head_dim=kv.head_dim,
        kv_dtype=kv.dtype,
        eos_token_ids=eos_token_ids(version_dir),
        default_max_tokens=generation.new_tokens if generation else DEFAULT_MAX_TOKENS,
        max_concurrent_generations=scheduler_limit(recipe),
        instances=recipe.triton.generate_instances,
        intra_op_threads=recipe.triton.generate_threads,
        continuous_batching=recipe.triton.continuous_batching,
        kv_cache_budget_mib=recipe.triton.kv_cache_budget_mib,
        **_generate_compute_runtime(recipe, staging, last_logits=any(s.name == "last_logits" for s in export.outputs)),
        **served_limits(recipe, build.profiles),
    )
    write_config(staging / name, cfg)
    return StagedModel(cfg, list(GENERATE_INPUTS), list(GENERATE_OUTPUTS), "python", None,
                       required_files=("tokenizer.json",))


#: The package shipped as the generation model (Triton's python backend runs it; it imports nothing of this one).
SERVED_PACKAGE = "pipeline.models.text_generation.served"


def write_served(version_dir: Path) -> None:
    """Write the generation model into ``version_dir``: its entry (``served/entry.py``) as ``model.py``,
    the python backend's file, and the other modules of :mod:`pipeline.models.text_generation.served`
    into ``served/``, which the entry loads as a package."""
    source = resources.files(SERVED_PACKAGE)
    (version_dir / "model.py").write_text(source.joinpath("entry.py").read_text())
    (version_dir / "served").mkdir(parents=True, exist_ok=True)
    for module in sorted(source.iterdir(), key=lambda f: f.name):
        if module.name.endswith(".py") and module.name != "entry.py":
            (version_dir / "served" / module.name).write_text(module.read_text())


def scheduler_limit(recipe: Recipe) -> int:
    """The generation model's scheduler limit per instance (``max_concurrent_generations``):
    ``triton.max_concurrent_generations``, else ``triton.max_batch_size`` (at least 1) as before
    the field existed."""
    given = recipe.triton.max_concurrent_generations
    return given if given is not None else max(1, recipe.triton.max_batch_size)


def served_limits(recipe: Recipe, profiles: Sequence[ResolvedProfile]) -> dict[str, int]:
    """The generation model's ``max_prompt_tokens`` and ``max_context``: the profiles' limits
    (:func:`pipeline.triton.repository.context_limits`), the context capped at the model's position
    table (:func:`pipeline.models.text_generation.model.position_table`): always for a learned one,
    for a rotary one unless ``triton.allow_context_beyond_max_positions``."""
    from pipeline.models.text_generation.model import position_table

    limits = context_limits(profiles)
    table = position_table(recipe.model)
    if table is None or table.size is None or table.kind == "none":
        return limits
    if table.kind == "rotary" and recipe.triton.allow_context_beyond_max_positions:
        return limits
    limits["max_context"] = min(limits["max_context"] or table.size, table.size)
    return limits


#: The conversation every chat template must render (user / assistant alternating, no system
#: message: some templates refuse one).
SAMPLE_CHAT = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
               {"role": "user", "content": "How are you?"}]


def check_chat_template(folder: Path) -> str | None:
    """Render the tokenizer folder's chat template (if it has one) on :data:`SAMPLE_CHAT` as
    transformers does (``apply_chat_template``, ``add_generation_prompt``), so that a template
    that cannot render fails the build, not every chat request. Returns the rendered text (None
    without a template).

    Raises:
        TritonConfigError: (exit 2) the template does not render; names the folder and the error.
    """
    tok = load_tokenizer(folder)
    if not getattr(tok, "chat_template", None):
        return None
    try:
        return tok.apply_chat_template(SAMPLE_CHAT, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2.TemplateError, or what the template raises (raise_exception)
        raise TritonConfigError(f"{folder}: the chat template does not render a sample conversation "
                                f"({type(e).__name__}: {e}); fix chat_template.jinja or tokenizer_config.json's "
                                "chat_template") from e


def _generate_compute_runtime(recipe: Recipe, staging: Path, *, last_logits: bool) -> dict:
    """How the generation model runs the compute graph: in its own process with ONNX Runtime when
    the staged compute model is the python-onnxruntime one (it ships model.py + model.onnx), else
    through BLS (``tensorrt_plan`` / ``onnxruntime_onnx``). ``last_logits``: the graph has that
    output ([batch, vocab]), which each step then requests instead of ``logits``."""
    version = str(recipe.triton.version)
    compute_dir = staging / recipe.triton.model_name
    logits = {"logits_output": "last_logits"} if last_logits else {}
    if not (compute_dir / version / "model.py").is_file():
        return {"compute_runtime": "bls", "compute_parameters": logits}
    params = parse_config((compute_dir / "config.pbtxt").read_text()).parameters
    onnx_file = params["onnx_file"].string_value if "onnx_file" in params else "model.onnx"
    forwarded = {k: params[k].string_value for k in ("graph_optimization_level", "dequantize_weights", "session_config")
                 if k in params}
    return {"compute_runtime": "onnxruntime",
            "compute_parameters": {"compute_onnx": f"{recipe.triton.model_name}/{version}/{onnx_file}", **forwarded,
                                   **logits}}


def kv_layout(inputs: Sequence[TensorSpec]) -> KVLayout:
    """:func:`pipeline.models.text_generation.kv.kv_layout` of the export's inputs (the one KV layout).

    Raises:
        TritonConfigError: no past inputs, layers not numbered 0..L-1 with a key
            and a value each, non-rank-4 or symbolic kv_heads/head_dim, or
            layers that disagree.
    """
    return _kv.kv_layout(inputs, error=TritonConfigError)


def _check_kv(model_name: str, kv: KVLayout, graph_inputs: Sequence[TensorSpec]) -> None:
    """The served graph must take the past tensors the generation model will send."""
    graph = {s.name: s for s in graph_inputs}
    for i in range(kv.num_layers):
        for kind in ("key", "value"):
            spec = graph.get(f"past_key_values.{i}.{kind}")
            if spec is None or len(spec.shape) != 4 or spec.shape[1] != kv.kv_heads or spec.shape[3] != kv.head_dim:
                raise TritonConfigError(
                    f"model '{model_name}': input past_key_values.{i}.{kind}: the served graph has "
                    f"{spec.shape if spec else 'no such input'}, the export has [batch, {kv.kv_heads}, "
                    f"past_sequence, {kv.head_dim}]"
                )


