"""Batched against alone prompt scoring on real exported graphs (docs/serving.md, "prompt logprobs").

What the served generation model does when it batches a prefill beside a sequence with a past: prompt B's
13 tokens are prefilled alone (past 0), then beside prompt A's last 13 tokens (A's 7-token past), so B's
row carries 7 left-padded, masked past positions. For each graph given it prints, over 6 random prompt
pairs, the largest change of a log-probability and the change of B's continuation log-likelihood (the sum
over B's next tokens), in nats. It asserts nothing: how much a graph amplifies the float32 rounding
differences depends on the graph (an FP8 Q/DQ can round a value to the next FP8 step) and on the CPU.

Usage: python benchmarks/batched_scoring_replay.py artifacts/fp8-llm/export/model.onnx \
           artifacts/fp8-llm/quantize/model.onnx
"""
import sys
import numpy as np
from pipeline.ort_sessions import ort_session

def logprobs(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

for path in sys.argv[1:]:
    s = ort_session(path)
    ins = {i.name: i for i in s.get_inputs()}
    pasts = [n for n in ins if n.startswith("past_key_values")]
    kvh, hd = ins[pasts[0]].shape[1], ins[pasts[0]].shape[3]
    outs = ["logits"] + [o.name for o in s.get_outputs() if o.name.startswith("present")]
    def run(ids, mask, past):
        feeds = {"input_ids": ids, "attention_mask": mask, **dict(zip(pasts, past))}
        r = s.run(outs, feeds)
        return r[0], r[1:]
    rng = np.random.default_rng(0)
    worst = 0.0
    for trial in range(6):
        a = rng.integers(100, 20000, 20); b = rng.integers(100, 20000, 13)
        empty = [np.zeros((1, kvh, 0, hd), np.float32) for _ in pasts]
        _, pa = run(a[None, :7], np.ones((1, 7), np.int64), empty)         # A's first chunk alone
        alone, _ = run(b[None], np.ones((1, 13), np.int64), empty)          # B alone, past 0
        past = [np.concatenate([p, np.zeros_like(p)], 0) for p in pa]       # B's row: 7 masked past slots
        mask = np.ones((2, 20), np.int64); mask[1, :7] = 0
        both, _ = run(np.stack([a[7:20], b]), mask, past)
        d = np.abs(logprobs(both[1]) - logprobs(alone[0]))
        tok = np.abs(np.take_along_axis(logprobs(both[1])[:-1], b[1:, None], 1) - np.take_along_axis(logprobs(alone[0])[:-1], b[1:, None], 1)).sum()
        worst = max(worst, tok)
        print(f"{path}: trial {trial}: max |dlogprob| {d.max():.3g}, sum over B's next tokens {tok:.3g} nats")
    print(f"{path}: worst continuation sum {worst:.3g} nats")
