"""Text data for calibration, validation and the bench: the texts of a recipe's
data source (:mod:`pipeline.sources.data`), token windows and greedy prompts cut
from them, and the built-in word-similarity sets.

* ``lee_background`` (gensim wheel): 300 news articles, one per line (Lee et al., 2005).
* ``wordsim353``, ``simlex999``: word pairs with human similarity scores.
"""
from __future__ import annotations

import hashlib

import numpy as np

from pipeline.sources.data import DataSource, load
from pipeline.sources.data.base import DataError
from pipeline.sources.data.corpus import CORPORA, WORD_SIM, test_data_dir
from pipeline.recipe.kinds import PROMPT_TOKENS

__all__ = ["CORPORA", "WORD_SIM", "DataError", "test_data_dir", "documents", "recipe_data_sha256", "word_pairs", "special_prefix",
           "serving_ids", "window_convention", "token_windows", "prompt_texts", "prompts"]


def documents(source: DataSource) -> list[str]:
    """The texts of a recipe data source's ``split``, in order: a document per record
    of a ``corpus`` (lee_background) or ``text`` source, the text field of a ``jsonl``
    one (labels dropped). ``source`` is bound to the recipe's folder (as
    :func:`pipeline.recipe.load.load_recipe` leaves it) and names its recipe key in errors.

    Raises:
        DataError: a file is missing or malformed, the split reaches past the data,
            or the source gives no texts (pairs, images, feeds); names the key.
    """
    kind = source.record_kind
    if kind == "documents":
        return source.items()
    if kind == "labeled_documents":
        return [record.input for record in source.items()]
    raise DataError(f"{source._where}: {source.describe()} gives {kind}, not texts; valid here: a corpus "
                    "(lee_background), text or jsonl source")


def recipe_data_sha256(recipe) -> str:
    """sha256 hex over the content hashes of a recipe's calibration and validate
    data (:meth:`DataSource.sha256`): part of every key of what is measured on them,
    so editing a data file in place invalidates the measurement.

    Raises:
        DataError: a data file is missing.
    """
    calibration = recipe.quantize.calibration
    sources = [recipe.validate_.data] + ([calibration.data] if calibration is not None else [])
    return hashlib.sha256("|".join(src.sha256() for src in sources).encode()).hexdigest()


_PROBE = "a"  # any text that tokenizes to something


def serving_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` exactly as the served generation model makes them:
    ``tokenizers.Tokenizer.encode(text)`` with its special tokens (the transformers
    tokenizer's backend is that same object, saved as ``tokenizer.json``).

    Returns a list of int ids, special tokens included.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text).ids)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def special_prefix(tokenizer) -> list[int]:
    """The BOS ids the tokenizer puts before every text when it adds special tokens.

    The one place that decides whether validation and calibration windows and
    greedy prompts start with a BOS. Derived by encoding a probe text with and
    without special tokens (so the post-processor template and ``add_bos_token``
    both count), and kept only when it holds the tokenizer's ``bos_token``: an
    encoder's ``[CLS]`` (no ``bos_token``) is not a BOS, so encoder calibration
    windows stay plain text.

    Returns a list of int ids, ``[]`` when no BOS is added (SmolLM2, BERT).

    Raises:
        DataError: the special-token encoding does not contain the plain one
            (a template that rewrites the text; no prefix can be derived).
    """
    plain = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    full = serving_ids(tokenizer, _PROBE)
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain]
    if not plain or not starts:
        raise DataError(f"tokenizer: encoding {_PROBE!r} with special tokens gives {full}, which does not contain "
                        f"its plain encoding {plain}; cannot tell which special tokens come first")
    prefix = full[: starts[0]]
    bos = getattr(tokenizer, "bos_token_id", None)
    return prefix if bos is not None and bos in prefix else []


def window_convention(tokenizer, seq_len: int) -> dict:
    """How :func:`token_windows` cuts and what a perplexity over them scores.

    Returns ``{"window_tokens", "stride_tokens" (text tokens per window),
    "bos" (bool), "scored_per_window" (next-token targets per window; the BOS
    and, without BOS, a window's first token are context only)}``.
    """
    prefix = special_prefix(tokenizer)
    return {"window_tokens": seq_len, "stride_tokens": seq_len - len(prefix), "bos": bool(prefix),
            "scored_per_window": seq_len - max(len(prefix), 1)}


def token_windows(tokenizer, docs: list[str], seq_len: int, max_windows: int) -> np.ndarray:
    """Concatenate documents (EOS between them) and cut fixed, non-overlapping windows.

    Each window is :func:`special_prefix` (the BOS the served model adds, if
    any) followed by ``seq_len - len(prefix)`` text tokens of the stream.

    Returns int64 ``[n, seq_len]`` with ``n <= max_windows``; a trailing
    partial window is dropped.

    Raises:
        DataError: ``seq_len`` leaves no text token after the prefix.
    """
    prefix = special_prefix(tokenizer)
    body = seq_len - len(prefix)
    if body < 1:
        raise DataError(f"seq_len={seq_len} leaves no text token after the {len(prefix)} BOS token(s)")
    sep = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in docs:
        # verbose=False: a document longer than model_max_length is expected, the windows cut it
        ids += tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"] + ([sep] if sep is not None else [])
        if len(ids) >= body * max_windows:
            break
    n = min(len(ids) // body, max_windows)
    rows = np.asarray(ids[: n * body], np.int64).reshape(n, body)
    return np.concatenate([np.full((n, len(prefix)), prefix, np.int64), rows], axis=1) if prefix else rows


def prompt_texts(tokenizer, docs: list[str], count: int, prompt_len: int = PROMPT_TOKENS) -> list[str]:
    """The leading text of ``count`` documents that spans exactly their first
    ``prompt_len`` text tokens (a document whose cut re-tokenizes differently,
    or that is shorter, is skipped).

    Raises:
        DataError: fewer usable documents than ``count``.
    """
    out: list[str] = []
    for doc in docs:
        enc = tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        if len(ids) < prompt_len:
            continue
        text = doc[: offsets[prompt_len - 1][1]]
        if tokenizer(text, add_special_tokens=False)["input_ids"] == ids[:prompt_len]:
            out.append(text)
        if len(out) == count:
            return out
    raise DataError(f"validate.data: the greedy prompts (validate.generation.prompts) need {count} documents of at "
                    f"least {prompt_len} tokens; the data gives {len(out)}; valid: a larger split, or fewer prompts")


def prompts(tokenizer, docs: list[str], count: int, prompt_len: int = PROMPT_TOKENS) -> np.ndarray:
    """Greedy-generation prompts, tokenized as the served model tokenizes them
    (:func:`serving_ids` of :func:`prompt_texts`: BOS included when the
    tokenizer adds one).

    Returns int64 ``[count, len(special tokens) + prompt_len]``.

    Raises:
        DataError: fewer usable documents than ``count``.
    """
    return np.asarray([serving_ids(tokenizer, t) for t in prompt_texts(tokenizer, docs, count, prompt_len)], np.int64)


def word_pairs(name: str) -> tuple[list[tuple[str, str]], np.ndarray]:
    """Word pairs and human scores (float64 ``[n]``) of a built-in word-similarity set."""
    pairs = load({"type": "corpus", "name": name}, None, where=f"{name} word pairs").items()
    return [(p.text_a, p.text_b) for p in pairs], np.asarray([p.score for p in pairs], np.float64)
