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
(:func:`pipeline.runtime.ort_session`, :func:`pipeline.models.llm.greedy_generate`)
so the verdict can say whether the server or the recorded tokens are off.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import PipelineError
from pipeline.serve.client import StreamClient
from pipeline.serve.prepare import Served
from pipeline.triton.repository import eos_token_ids


@dataclass
class PromptCheck:
    """One validate prompt: streamed tokens, the validate stage's, and the batch-1 reference if needed."""

    index: int
    streamed: list[int]
    expected: list[int]  # validate tokens up to and including the first EOS
    reference: list[int] | None = None  # batch-1 greedy, only when streamed != expected
    finish: str = ""  # the stream's finish_reason and detail, e.g. "length: max_tokens 32 reached"

    @property
    def first_difference(self) -> int | None:
        """First position where the streamed tokens and the validate tokens differ (None: equal)."""
        for k, (a, b) in enumerate(zip(self.streamed, self.expected)):
            if a != b:
                return k
        return None if len(self.streamed) == len(self.expected) else min(len(self.streamed), len(self.expected))

    @property
    def ok(self) -> bool:
        return self.streamed == self.expected

    @property
    def verdict(self) -> str:
        if self.streamed == self.expected:
            return f"equal to the validate stage's {len(self.expected)} greedy tokens"
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


def check_greedy(served: Served, grpc_url: str, prompts: Sequence[int] | None = None) -> list[PromptCheck]:
    """Stream each validate prompt (``prompts``: indices, default all) and compare.

    Raises:
        PipelineError: the recipe has no generation model or its run no greedy tokens.
        ServeClientError: the server answered with an error.
    """
    greedy = served.artifacts["validate"].greedy_tokens
    precision = served.artifacts["quantize"].precision
    if not served.generate_model or precision not in greedy:
        raise PipelineError(f"{served.recipe.name}: no generation model or no validate greedy tokens "
                            "(validate.generation) to compare with")
    eos = set(eos_token_ids(Path(served.artifacts["export"].tokenizer_dir)))
    indices = range(len(greedy["prompt_ids"])) if prompts is None else prompts
    checks, reference = [], _BatchOneReference(served)
    with StreamClient(grpc_url) as client:
        for i in indices:
            want = cut_at_eos(greedy[precision][i], eos)
            gen = client.generate(served.generate_model, input_ids=greedy["prompt_ids"][i],
                                  max_tokens=len(greedy[precision][i]))
            finish = f"{gen.finish_reason}: {gen.detail}" if gen.detail else gen.finish_reason
            check = PromptCheck(i, gen.tokens, want, finish=finish)
            if gen.tokens != want:
                check.reference = cut_at_eos(reference(greedy["prompt_ids"][i], len(greedy[precision][i])), eos)
            checks.append(check)
    return checks


class _BatchOneReference:
    """Greedy decode of one prompt with the validate stage's session and loop (loaded on first use)."""

    def __init__(self, served: Served):
        self.artifacts = served.artifacts
        self.session: Any = None  # onnxruntime.InferenceSession once loaded

    def __call__(self, prompt_ids: Sequence[int], new_tokens: int) -> list[int]:
        from pipeline.models.llm import greedy_generate, layout_from_specs
        from pipeline.runtime import ort_session

        export = self.artifacts["export"]
        if self.session is None:
            self.session = ort_session(self.artifacts["quantize"].onnx_path)
        layout = layout_from_specs(export.inputs, export.outputs)
        ids = np.asarray([prompt_ids], np.int64)
        return greedy_generate(lambda f: self.session.run(None, f), layout, ids, new_tokens)[0].tolist()
