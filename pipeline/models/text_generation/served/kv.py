"""The KV cache of the served sequences: each sequence's own preallocated
[kv_heads, prompt + max_tokens, head_dim] arrays per layer, gathered left-padded into a step's feeds
(or the previous step's present reused as they are), and the new entries copied back after it."""
import math

import numpy as np


class KVCache:
    """The KV-cache side of :class:`~.model.TritonPythonModel` (a mixin: the geometry is the model's)."""

    def _kv_budget(self, mib):
        """(budget in KV tokens, a log line with the formula)."""
        geometry = (f"L {self.layers} x H_kv {self.kv_heads} x D {self.head_dim} x {self.kv_dtype.itemsize} bytes")
        if mib > 0:
            tokens = int(mib * 2**20 // self.token_bytes)
            return tokens, (f"KV cache budget {mib:g} MiB (triton.kv_cache_budget_mib) = {tokens} tokens at "
                            f"2 x {geometry} = {self.token_bytes} bytes per token")
        if not self.max_context:
            return math.inf, "KV cache budget unbounded (no context limit in the profile)"
        tokens = self.max_batch * self.max_context
        return tokens, (f"KV cache budget {tokens * self.token_bytes / 2**20:.2f} MiB = 2 x B {self.max_batch} x "
                        f"S {self.max_context} x {geometry}")

    def _allocate(self, seq):
        shape = (self.kv_heads, seq.capacity, self.head_dim)
        return [np.empty(shape, self.kv_dtype) for _ in self.past_names]

    def feeds(self, seqs, n):
        """Compute-model feeds for ``seqs`` feeding ``n`` tokens each: input_ids int64 [B, n];
        attention_mask int64 [B, P + n], 0 over each row's left padding; past [B, H, P, D] with
        each sequence's KV right-aligned (P = the longest past)."""
        batch, longest = len(seqs), max(s.length for s in seqs)
        feeds = {"input_ids": np.array([s.pending[:n] for s in seqs], np.int64),
                 "attention_mask": np.zeros((batch, longest + n), np.int64)}
        past = [np.zeros((batch, self.kv_heads, longest, self.head_dim), self.kv_dtype) for _ in self.past_names]
        for b, seq in enumerate(seqs):
            feeds["attention_mask"][b, longest - seq.length:] = 1
            for buffer, kv in zip(past, seq.kv):
                buffer[b, :, longest - seq.length:] = kv[:, :seq.length]
        feeds.update(zip(self.past_names, past))
        return feeds

    def _forward(self, seqs, n):
        """One compute call; each sequence's KV gets its n new entries. Returns last logits [B, vocab].

        When the previous step ran the same sequences and nothing else touched them, its
        present tensors and mask are this step's past and mask (the padded layout is unchanged):
        no gather of the whole KV cache."""
        longest = max(s.length for s in seqs)
        key, last = [id(s) for s in seqs], getattr(self.thread_state, "last_step", None)
        if last is not None and last[0] == key and last[1] == [s.length for s in seqs]:
            feeds = {"input_ids": np.array([s.pending[:n] for s in seqs], np.int64),
                     "attention_mask": np.concatenate([last[2], np.ones((len(seqs), n), np.int64)], axis=1)}
            feeds.update(zip(self.past_names, last[3]))
        else:
            feeds = self.feeds(seqs, n)
        self.thread_state.last_step = None
        full = any(s.scoring for s in seqs)  # prompt logprobs: every position's logits
        logits, *present = self.compute(feeds, ["logits", *self.present_names]) if full else self.compute(feeds)
        logits = self._known_ids_only(logits)
        self.thread_state.last_step = (key, [s.length + n for s in seqs], feeds["attention_mask"], present)
        for b, seq in enumerate(seqs):
            if seq.scoring:
                seq.score(logits[b], seq.length)
            for kv, new in zip(seq.kv, present):
                kv[:, seq.length:seq.length + n] = new[b, :, longest:longest + n]
            seq.length += n
            del seq.pending[:n]
        with self.stats_lock:
            self.histogram[len(seqs)] += 1
        return logits if self.logits_name == "last_logits" and not full else logits[:, -1]

    def _known_ids_only(self, logits):
        """``logits`` [..., vocab] with every id past the tokenizer's (``token_ids``) at -inf. A model
        whose embedding is padded past its tokenizer (65536 rows for 49152 tokens) has logits for ids
        that decode to nothing: they are never sampled, and never listed among the top logprobs."""
        if logits.shape[-1] <= self.token_ids:
            return logits
        logits = np.array(logits)  # a copy: the compute output may be read-only
        logits[..., self.token_ids:] = -np.inf
        return logits
