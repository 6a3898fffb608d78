"""Validation tokenizes as the served model does: BOS windows, prompts, scoring (seconds)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from conftest import ROOT
from pipeline.models import text as text_data
from pipeline.models.text_generation import metrics as tg_metrics

WORDS = "the cat sat on a mat and dog ran to red big house".split()
DOCS = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(9 + i)) for i in range(12)]


def _word_tokenizer(template: str | None) -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    if template:
        tk.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 1), ("</s>", 2)])
    return tk


@pytest.fixture(params=[True, False], ids=["bos", "no-bos"])
def saved(request, tmp_path):
    """A tiny tokenizer saved as the export stage saves one, reloaded as validate loads it.

    Returns ``(transformers tokenizer, served tokenizers.Tokenizer, adds_bos)``.
    """
    from transformers import PreTrainedTokenizerFast

    from pipeline.sources.model import load_tokenizer

    tk = _word_tokenizer("<s> $A" if request.param else None)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    wrapped.save_pretrained(tmp_path)
    served = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))  # what generate_model.py loads
    return load_tokenizer(str(tmp_path)), served, request.param


def _stream(tok) -> list[int]:
    ids: list[int] = []
    for doc in DOCS:
        ids += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return ids


def test_special_prefix_is_the_bos_the_template_adds(saved):
    tok, served, bos = saved
    assert text_data.special_prefix(tok) == ([1] if bos else [])
    assert served.encode("cat").ids == text_data.special_prefix(tok) + [4]


def test_windows_start_with_bos_and_cover_the_stream_without_overlap(saved):
    tok, _, bos = saved
    windows = text_data.token_windows(tok, DOCS, seq_len=8, max_windows=5)
    stride = 7 if bos else 8
    assert windows.shape == (5, 8) and windows.dtype == np.int64
    body = windows[:, 1:] if bos else windows
    assert body.reshape(-1).tolist() == _stream(tok)[: 5 * stride]
    if bos:
        assert (windows[:, 0] == 1).all() and not (windows[:, 1:] == 1).any()
    assert text_data.window_convention(tok, 8) == {"window_tokens": 8, "stride_tokens": stride, "bos": bos,
                                              "scored_per_window": 7}


def test_windows_refuse_a_length_with_no_room_after_bos(saved):
    tok, _, bos = saved
    if bos:
        with pytest.raises(text_data.DataError, match="seq_len=1 leaves no text token after the 1 BOS"):
            text_data.token_windows(tok, DOCS, seq_len=1, max_windows=2)


def test_prompts_are_encoded_as_the_served_model_encodes_them(saved):
    tok, served, bos = saved
    texts = text_data.prompt_texts(tok, DOCS, count=3, prompt_len=5)
    ids = text_data.prompts(tok, DOCS, count=3, prompt_len=5)
    assert texts == [" ".join(d.split()[:5]) for d in DOCS[:3]]
    assert ids.tolist() == [served.encode(t).ids for t in texts]
    assert ids.shape == (3, 6 if bos else 5) and (ids[:, 0] == 1).all() == bos


def test_bos_is_context_only_never_a_scored_token():
    ids = np.array([[1, 5, 6, 7], [1, 8, 9, 5]], np.int64)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 4, 16)).astype(np.float32)
    logits[:, :, 1] = 50.0  # BOS almost certain: scoring it would pull the NLL down
    total, count = tg_metrics.mean_nll(logits, ids, context=1)
    lp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    expected = -sum(lp[b, t - 1, ids[b, t]] for b in range(2) for t in range(1, 4))
    assert count == 6 and math.isclose(total, expected, rel_tol=1e-9)
    # a two-token prefix: only positions 2.. are targets
    total2, count2 = tg_metrics.mean_nll(logits, ids, context=2)
    assert count2 == 4 and math.isclose(total2, -sum(lp[b, t - 1, ids[b, t]] for b in range(2) for t in (2, 3)),
                                        rel_tol=1e-9)
    with pytest.raises(ValueError, match="context=4"):
        tg_metrics.mean_nll(logits, ids, context=4)


def test_convention_names_window_stride_and_bos(saved):
    tok, _, bos = saved
    text = tg_metrics.convention_text(text_data.window_convention(tok, 256))
    assert "windows of 256 tokens" in text
    assert f"stride {255 if bos else 256} text tokens" in text and "255 scored tokens per window" in text
    assert ("BOS: yes" if bos else "BOS: no") in text


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory):
    from tiny import smollm2_tokenizer as load  # the GGUF's tokenizer, without its weights

    return load(tmp_path_factory.mktemp("smollm2-tokenizer"))


def test_smollm2_adds_no_prefix_so_its_windows_and_prompts_are_unchanged(smollm2_tokenizer):
    """The shipped recipe's token streams are the pre-BOS ones: plain text windows, and
    prompts that are each document's first 16 tokens."""
    from pipeline.recipe.load import load_recipe

    tok = smollm2_tokenizer
    v = load_recipe(ROOT / "recipes" / "fp8-llm.yaml").validate_
    assert text_data.special_prefix(tok) == [] and not text_data.window_convention(tok, v.seq_len)["bos"]
    docs = text_data.documents(v.data)
    stream: list[int] = []
    for doc in docs:
        stream += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    windows = text_data.token_windows(tok, docs, v.seq_len, v.max_windows)
    n = min(v.max_windows, len(stream) // v.seq_len)  # fp8-llm asks for more windows than its split holds
    assert windows.shape == (n, v.seq_len)
    assert windows.reshape(-1).tolist() == stream[: n * v.seq_len]
    firsts = [ids[:16] for ids in (tok(d, add_special_tokens=False)["input_ids"] for d in docs) if len(ids) >= 16]
    assert text_data.prompts(tok, docs, v.generation.prompts).tolist() == firsts[: v.generation.prompts]


class _FakeLM:
    """An ORT-session stand-in: logits favour ``(id + 1) % V``; records every input_ids fed."""

    def __init__(self, vocab: int):
        self.vocab, self.fed = vocab, []

    def run(self, names, feeds):
        ids = feeds["input_ids"]
        self.fed.append(ids.copy())
        logits = np.zeros((*ids.shape, self.vocab), np.float32)
        np.put_along_axis(logits, ((ids + 1) % self.vocab)[..., None], 4.0, axis=-1)
        if names == ["logits"]:
            return [logits]
        total = feeds["attention_mask"].shape[1]
        present = np.zeros((ids.shape[0], 1, total, 2), np.float32)
        return [logits, *[present] * 2]


def test_validate_scores_bos_windows_and_serving_prompts(saved, monkeypatch):
    """llm_metrics end to end on fake sessions: windows fed with the BOS, the
    convention named, BOS never counted, prompts as the served model makes them."""
    from pipeline.artifacts import ExportArtifact, QuantizedArtifact, TensorSpec
    from pipeline.context import Progress
    from pipeline.recipe.load import load_recipe

    tok, served, bos = saved
    vocab = len(tok)
    sessions = {"fp32.onnx": _FakeLM(vocab), "fp8.onnx": _FakeLM(vocab)}
    monkeypatch.setattr("pipeline.ort_sessions.ort_session", lambda path: sessions[path])
    monkeypatch.setattr("pipeline.runners.weights_fed.WeightsFed.load", lambda path: None)  # stand-ins have no weights
    monkeypatch.setattr(text_data, "documents", lambda source: DOCS)
    for user in ("pipeline.models.text_generation.metrics", "pipeline.models.text_generation.adapter"):
        monkeypatch.setattr(f"{user}.load_tokenizer", lambda folder: tok)
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {
        "validate.seq_len": 8, "validate.max_windows": 4, "validate.batch_size": 2,
        "validate.generation": {"prompts": 2, "new_tokens": 3}})
    specs = [TensorSpec("past_key_values.0.key", "float32", ["batch", 1, "past_sequence", 2]),
             TensorSpec("past_key_values.0.value", "float32", ["batch", 1, "past_sequence", 2])]
    exp = ExportArtifact("fp32.onnx", specs, [TensorSpec("logits", "float32", ["batch", "sequence", vocab])], "tok")
    ctx = type("Ctx", (), {"recipe": recipe, "progress": Progress(quiet=True)})()
    metrics, tokens = tg_metrics.llm_metrics(ctx, exp, QuantizedArtifact("fp8.onnx", "fp8", [], []))

    windows = np.concatenate(sessions["fp32.onnx"].fed[:2])
    assert windows.shape == (4, 8) and (windows[:, 0] == 1).all() == bos
    assert metrics["eval_windows"] == 4 and metrics["eval_tokens"] == 4 * 7
    assert ("BOS: yes" if bos else "BOS: no") in metrics["perplexity_convention"]
    texts = text_data.prompt_texts(tok, DOCS, 2)
    assert tokens["prompt_ids"] == [served.encode(t).ids for t in texts]
    # the first greedy feed of each prompt is exactly the served token ids
    assert [f.tolist()[0] for f in sessions["fp32.onnx"].fed[2:] if f.shape[1] > 1] == tokens["prompt_ids"]
    # perplexity over exactly the 7 targets after each window's first token (never the BOS)
    lse = math.log(math.exp(4.0) + vocab - 1)
    hits = windows[:, 1:] == (windows[:, :-1] + 1) % vocab
    expected = math.exp(float(np.where(hits, lse - 4.0, lse).mean()))
    assert math.isclose(metrics["perplexity_fp32"], expected, rel_tol=1e-9)
