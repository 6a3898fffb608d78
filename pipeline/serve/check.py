"""Smoke check: the served generation model's greedy tokens against the validate stage's.

The validate stage decodes its prompts greedily one at a time (batch 1, as the
served model does) and never stops at EOS. The generation model stops at EOS. So a prompt is
compared up to and including the validate tokens' first EOS, with the exact
prompt token ids (``input_ids``, no detokenize / retokenize round trip).

Batch-vs-single numerics: a GEMM over 8 rows and one over 1 row may sum in a
different order; in a Q/DQ graph that last-bit difference can move an
activation across an FP8/INT8 rounding boundary, and greedy decoding can then
follow another near-tie token. That is why validate decodes at
batch 1. A prompt passes only when the streamed tokens equal the validate
stage's exactly; when they differ, the prompt is decoded again offline at
batch 1 with the validate stage's own ONNX Runtime session and greedy loop
(:func:`pipeline.ort_sessions.ort_session`, :func:`pipeline.models.text_generation.model.greedy_generate`)
so the verdict can say whether the server or the recorded tokens are off.

Under in-flight batching (``concurrency`` > 1: the prompts stream at once, so the
generation model decodes them in one padded batch) a padded or batched GEMM may flip
a near tie. Then a prompt passes when its tokens equal the batch-1 reference up to the
reference's first near tie: the first position whose top-2 logit gap is below
``tie_tolerance`` (default :data:`TIE_TOLERANCE` logits); from there on the two may
follow different tokens. :func:`near_tie_summary` says how many prompts reached such
a position. At concurrency 1 the streamed tokens must equal the validate stage's exactly.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import PipelineError
from pipeline.serve.client import StreamClient
from pipeline.serve.prepare import Served
from pipeline.triton.repository import eos_token_ids

#: A reference position is a near tie when its top-2 logits are closer than this (logits).
#: Measured on fp8-llm (benchmarks/generate_scheduler.py, 8 prompts x 24 tokens, staggered
#: so padded batches of 1-8 formed): batched decoding first left the batch-1 tokens at
#: positions whose batch-1 top-2 gap was 0.013 to 0.134 logits (6 of 8 prompts; an FP8 Q/DQ
#: activation moved across a rounding boundary); the FP32 export never differed. 0.25 covers
#: those with margin; a real padding or position bug differs where the gap is far larger.
TIE_TOLERANCE = 0.25


@dataclass
class PromptCheck:
    """One validate prompt: streamed tokens, the validate stage's, and the batch-1 reference if needed."""

    index: int
    streamed: list[int]
    expected: list[int]  # validate tokens up to and including the first EOS
    reference: list[int] | None = None  # batch-1 greedy, only when streamed != expected
    finish: str = ""  # the stream's finish_reason and detail, e.g. "length: max_tokens 32 reached"
    batched: bool = False  # streamed with other prompts at once (concurrency > 1)
    gaps: list[float] | None = None  # the reference's top-2 logit gap at each position
    tie_tolerance: float = TIE_TOLERANCE

    @property
    def near_tie(self) -> int | None:
        """First reference position whose top-2 logit gap is below ``tie_tolerance`` (None: none)."""
        for k, gap in enumerate(self.gaps or []):
            if gap < self.tie_tolerance:
                return k
        return None

    @property
    def tie_excused(self) -> bool:
        """Batched, differing, but equal to the reference up to its first near tie."""
        k = self.near_tie
        return (self.batched and self.reference is not None and k is not None and self.streamed != self.reference
                and self.streamed[:k] == self.reference[:k] and len(self.streamed) > k)

    @property
    def first_difference(self) -> int | None:
        """First position where the streamed tokens and the validate tokens differ (None: equal)."""
        for k, (a, b) in enumerate(zip(self.streamed, self.expected)):
            if a != b:
                return k
        return None if len(self.streamed) == len(self.expected) else min(len(self.streamed), len(self.expected))

    @property
    def ok(self) -> bool:
        return self.streamed == self.expected or (self.batched and self.streamed == self.reference) or self.tie_excused

    @property
    def verdict(self) -> str:
        if self.streamed == self.expected:
            return f"equal to the validate stage's {len(self.expected)} greedy tokens"
        if self.tie_excused:
            k = self.near_tie
            assert k is not None and self.gaps is not None
            return (f"batched: equal to the batch-1 reference up to position {k}, a near tie (top-2 logit gap "
                    f"{self.gaps[k]:.4f} < {self.tie_tolerance}); the tokens differ from there")
        if self.streamed == self.reference:
            return (f"MISMATCH with the validate tokens from position {self.first_difference}, but equal to a fresh "
                    f"batch-1 greedy run of the same graph: the recorded validate tokens are stale or were batched")
        ended = f" (stream ended: {self.finish})" if self.finish else ""
        return (f"MISMATCH from position {self.first_difference}: streamed {self.streamed} "
                f"expected {self.expected}{ended}")


def cut_at_eos(tokens: Sequence[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS id."""
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos:
            break
    return out


#: (prompt token ids, max new tokens) -> (generated token ids, finish reason / detail): one greedy request.
Generate = Callable[[list[int], int], tuple[list[int], str]]


def grpc_generate(grpc_url: str, model: str) -> Generate:
    """:data:`Generate` streaming ``model`` over Triton's gRPC (:class:`StreamClient`, ``input_ids``)."""
    def generate(prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        with StreamClient(grpc_url) as client:
            gen = client.generate(model, input_ids=prompt, max_tokens=max_tokens)
        return gen.tokens, f"{gen.finish_reason}: {gen.detail}" if gen.detail else gen.finish_reason
    return generate


def check_greedy(served: Served, grpc_url: str, prompts: Sequence[int] | None = None, *, concurrency: int = 1,
                 tie_tolerance: float = TIE_TOLERANCE, generate: Generate | None = None) -> list[PromptCheck]:
    """Stream each validate prompt (``prompts``: indices, default all) and compare.

    ``concurrency`` > 1 streams that many prompts at once (so the generation model
    batches them) and excuses a difference after the batch-1 reference's first near
    tie (top-2 logit gap < ``tie_tolerance``); see the module docstring. ``generate``:
    how a prompt is sent (default :func:`grpc_generate` on ``grpc_url``; the bench passes
    an OpenAI-client one).

    Raises:
        PipelineError: the recipe has no generation model or its run no greedy tokens,
            or ``concurrency`` < 1.
        ServeClientError: the server answered with an error.
    """
    if concurrency < 1:
        raise PipelineError(f"check concurrency must be >= 1; got {concurrency}")
    greedy = served.artifacts["validate"].greedy_tokens
    precision = served.artifacts["quantize"].precision
    if not served.generate_model or precision not in greedy:
        raise PipelineError(f"{served.recipe.name}: no generation model or no validate greedy tokens "
                            "(validate.generation) to compare with")
    eos = set(eos_token_ids(Path(served.artifacts["export"].tokenizer_dir)))
    indices = range(len(greedy["prompt_ids"])) if prompts is None else prompts
    reference = _BatchOneReference(served)
    send = generate or grpc_generate(grpc_url, served.generate_model)

    with ThreadPoolExecutor(concurrency) as pool:
        gens = list(pool.map(lambda i: send(list(greedy["prompt_ids"][i]), len(greedy[precision][i])), indices))
    checks = []
    for i, (tokens, finish) in zip(indices, gens):
        want = cut_at_eos(greedy[precision][i], eos)
        check = PromptCheck(i, tokens, want, finish=finish, batched=concurrency > 1, tie_tolerance=tie_tolerance)
        if tokens != want:
            tokens, gaps = reference(greedy["prompt_ids"][i], len(greedy[precision][i]))
            check.reference = cut_at_eos(tokens, eos)
            check.gaps = gaps[:len(check.reference)]
        checks.append(check)
    return checks


def near_tie_summary(checks: Sequence[PromptCheck]) -> str:
    """How many prompts reached a near tie of the batch-1 reference and differed from there."""
    excused = [c.index for c in checks if c.tie_excused]
    tolerance = checks[0].tie_tolerance if checks else TIE_TOLERANCE
    return (f"{len(excused)} of {len(checks)} prompts reached a near tie (top-2 logit gap < {tolerance}) of the "
            f"batch-1 reference and differed from there" + (f": prompts {excused}" if excused else ""))


class _BatchOneReference:
    """Greedy decode of one prompt with the validate stage's session and loop (loaded on first use)."""

    def __init__(self, served: Served):
        self.artifacts = served.artifacts
        self.session: Any = None  # onnxruntime.InferenceSession once loaded

    def __call__(self, prompt_ids: Sequence[int], new_tokens: int) -> tuple[list[int], list[float]]:
        """(greedy tokens, top-2 logit gap at each position)."""
        from pipeline.models.text_generation.model import greedy_generate, layout_from_specs
        from pipeline.ort_sessions import ort_session, run_checked

        export, quantized = self.artifacts["export"], self.artifacts["quantize"]
        if self.session is None:
            self.session = ort_session(quantized.ort_path)
        layout = layout_from_specs(export.inputs, export.outputs)
        ids = np.asarray([prompt_ids], np.int64)
        gaps: list[float] = []

        def step(feeds):
            outputs = run_checked(self.session, None, feeds, graph=quantized.ort_path, stage="serve check",
                                  user_graph=not quantized.quantized_nodes)
            top2 = np.sort(outputs[0][0, -1])[-2:]
            gaps.append(float(top2[1] - top2[0]))
            return outputs

        return greedy_generate(step, layout, ids, new_tokens)[0].tolist(), gaps
