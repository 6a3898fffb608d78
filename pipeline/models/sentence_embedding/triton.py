"""Triton models of the sentence-embedding kind: the tokenizer model (text -> the
graph's int64 inputs, ``templates/tokenizer_model.py``) and the text -> embedding
ensemble. Written into the staging folder of
:func:`pipeline.stages.triton.write_repository`, which checks and publishes them."""
from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import BuildArtifact, ExportArtifact, TensorSpec
from pipeline.errors import TritonConfigError
from pipeline.recipe.schema import Recipe
from pipeline.triton.config import (
    TOKENIZER_INPUT,
    check_ensemble,
    check_tokenizer_outputs,
    ensemble_config,
    tokenizer_config,
)
from pipeline.triton.repository import (
    StagedModel,
    context_limits,
    copy_tokenizer,
    ensemble_model_name,
    json_field,
    special_token_id,
    tokenizer_model_name,
    write_config,
    write_template,
)

DEFAULT_MAX_LENGTH = 512  # encoder tokenizer truncation when the profile gives no input_ids max
PAD_TO_MULTIPLE_OF = 16  # encoder tokenizer: row length rounded up to this (shape buckets for batching)


def stage_text_models(
    recipe: Recipe, export: ExportArtifact, compute: StagedModel, build: BuildArtifact, staging: Path
) -> list[StagedModel]:
    """Tokenizer model (template + tokenizer files) and the text -> embedding ensemble."""
    name = recipe.triton.model_name
    version = str(recipe.triton.version)
    tok_dir = staging / tokenizer_model_name(name) / version
    check_tokenizer_outputs(tokenizer_model_name(name), [s.name for s in compute.inputs], recipe.triton.max_batch_size)
    copy_tokenizer(Path(export.tokenizer_dir), tok_dir)
    write_template("tokenizer_model.py", tok_dir / "model.py")
    tokenizer = tokenizer_config(
        tokenizer_model_name(name), max_batch_size=recipe.triton.max_batch_size, outputs=[s.name for s in compute.inputs],
        max_length=truncation_length(recipe, build.profiles),
        pad_id=pad_token_id(tok_dir), pad_to_multiple_of=PAD_TO_MULTIPLE_OF,
    )
    ensemble = ensemble_config(ensemble_model_name(name), tokenizer, compute.config)
    check_ensemble(ensemble, {m.name: m for m in (tokenizer, compute.config)})
    (staging / ensemble.name / version).mkdir(parents=True)
    for cfg in (tokenizer, ensemble):
        write_config(staging / cfg.name, cfg)
    text = [TensorSpec(TOKENIZER_INPUT, "object", ["batch", 1])]
    ids = [TensorSpec(s.name, "int64", ["batch", "sequence"]) for s in compute.inputs]
    return [StagedModel(tokenizer, text, ids, "python", None, required_files=("tokenizer.json",)),
            StagedModel(ensemble, text, compute.outputs, "ensemble", None)]


def truncation_length(recipe: Recipe, profiles) -> int:
    """Tokens the tokenizer model keeps: the smaller of the profiles' ``input_ids`` sequence max
    and the model folder's ``sentence_bert_config.json`` ``max_seq_length``, whichever are given
    (:data:`DEFAULT_MAX_LENGTH` when neither is; a source folder no longer there gives none)."""
    from pipeline.models.sentence_embedding.model import max_seq_length
    from pipeline.sources.model import ModelFileError, package_file

    try:
        folder = package_file(recipe.model)
    except ModelFileError:
        folder = None
    limits = [context_limits(profiles)["max_prompt_tokens"],
              max_seq_length(folder) if folder is not None and folder.is_dir() else None]
    return min((v for v in limits if v), default=DEFAULT_MAX_LENGTH)


def pad_token_id(tokenizer_dir: Path) -> int:
    """Pad id: ``pad_token`` of tokenizer_config.json / special_tokens_map.json looked up in
    tokenizer.json, else tokenizer.json's ``padding.pad_id``.

    Raises:
        TritonConfigError: no pad token named, or the named one is not in the vocabulary.
    """
    token_id = special_token_id(tokenizer_dir, "pad_token")
    if token_id is not None:
        return token_id
    padding = json_field(tokenizer_dir / "tokenizer.json", "padding")
    if isinstance(padding, dict) and "pad_id" in padding:
        return int(padding["pad_id"])
    raise TritonConfigError(f"{tokenizer_dir}: no pad_token in tokenizer_config.json or special_tokens_map.json and "
                            "no padding in tokenizer.json; the encoder tokenizer model pads batches with it")


