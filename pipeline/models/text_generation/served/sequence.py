"""One request's generation state (:class:`Sequence`)."""
from .decoding import StopStrings
from .scoring import log_softmax, top_logprobs


class Sequence:
    """One request's generation state: tokens still to feed, its own KV, sampling and stop state.
    ``prompt_k`` / ``gen_k``: top counts of prompt / generated-token logprobs (None: not asked)."""

    def __init__(self, request, sender, prompt, max_tokens, eos, sampling, stops, decoder,
                 prompt_k=None, gen_k=None):
        self.request, self.sender, self.prompt = request, sender, prompt
        self.max_tokens, self.eos, self.sampling = max_tokens, eos, sampling
        self.stopper, self.decoder = StopStrings(stops), decoder
        self.pending = list(prompt)  # tokens to feed at the next steps
        self.length = self.generated = 0  # tokens in the KV; tokens generated
        self.kv = None  # per past name: [kv_heads, capacity, head_dim], allocated on admission
        self.done = False
        self.prompt_k, self.gen_k = prompt_k, gen_k
        self.hide = []  # special-token texts cut from the text sent (the decoder keeps them)
        self.prompt_lp = [None] if prompt_k is not None else None  # the first token has no logprob
        self.prompt_top = [None] if prompt_k is not None else None

    @property
    def scoring(self):
        """Prompt logprobs asked and not all computed yet."""
        return self.prompt_k is not None and len(self.prompt_lp) < len(self.prompt)

    def score(self, rows, start):
        """Record the logprobs of the prompt tokens that logits ``rows`` [n, vocab] (positions
        ``start``.. of the sequence) predict."""
        lp = log_softmax(rows[:max(0, min(len(rows), len(self.prompt) - 1 - start))])
        for j, row in enumerate(lp):
            token = self.prompt[start + j + 1]
            self.prompt_lp.append(float(row[token]))
            self.prompt_top.append(top_logprobs(row, self.prompt_k))

    def prompt_logprobs(self):
        return {"ids": list(self.prompt), "logprobs": self.prompt_lp, "top": self.prompt_top}

    @property
    def capacity(self):
        """KV positions reserved: prompt + max_tokens."""
        return len(self.prompt) + self.max_tokens

    @property
    def prefilling(self):
        return len(self.pending) > 1

    def cancelled(self):
        return hasattr(self.request, "is_cancelled") and self.request.is_cancelled()

