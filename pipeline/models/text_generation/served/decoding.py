"""Streaming text and choosing tokens: :class:`IncrementalDecoder` (the text each new token adds),
:class:`StopStrings` (text cut at the first stop string, held back while it may begin one) and
:class:`Sampling` (greedy, temperature, top_k, top_p, seeded)."""
import numpy as np


class IncrementalDecoder:
    """Text of a growing list of token ids, one piece per added token (prefix-offset method).

    Decoding each new id alone loses what depends on its neighbours: a Metaspace
    (SentencePiece-style) decoder drops the word-initial space of the first token
    it decodes, and the byte tokens of one UTF-8 character decode to "\ufffd" until
    the last one arrives. So :meth:`add` decodes the window ``ids[prefix:]`` and
    its already-shown part ``ids[prefix:read]`` and returns the difference once it
    does not end in "\ufffd" (else "" and the text waits); then the window moves
    on. The pieces of every :meth:`add` plus :meth:`flush` join to
    ``tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)``.

    ``context``: the last prompt ids (at most :attr:`CONTEXT` are kept), already shown, so
    the first generated token decodes as it continues the prompt: a Metaspace "▁Paris"
    after "The capital is" gives " Paris", not "Paris". The pieces then join to the text
    ``decode(context + ids)`` adds to ``decode(context)``.
    """

    #: prompt ids kept as context (a word, or one multi-byte character)
    CONTEXT = 6

    def __init__(self, tokenizer, skip_special_tokens=True, context=()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = [int(i) for i in list(context)[-self.CONTEXT:]]
        self.prefix, self.read = 0, len(self.ids)

    def _pending(self):
        """(text shown from the window, the window's whole text)."""
        shown = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip_special_tokens)
        text = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=self.skip_special_tokens)
        return shown, text

    def add(self, token):
        """Append one id (int); return the new text it completes (may be "")."""
        self.ids.append(int(token))
        shown, text = self._pending()
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown):]

    def flush(self):
        """The text held back so far (an incomplete UTF-8 sequence decodes to "\ufffd")."""
        shown, text = self._pending()
        self.prefix = self.read = len(self.ids)
        return text[len(shown):]


class StopStrings:
    """Text released to the client, cut at the first stop string.

    :meth:`add` takes a decoded piece and returns ``(text to send, the stop string
    hit or None)``; text that could be the start of a stop string is held back
    until the following pieces show it is not.
    """

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.text, self.sent = "", 0

    def add(self, piece):
        self.text += piece
        hits = [(self.text.find(s, self.sent), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            out, self.sent = self.text[self.sent:index], len(self.text)
            return out, stop
        end = len(self.text) - self._held()
        out, self.sent = self.text[self.sent:end], end
        return out, None

    def _held(self):
        """Length of the longest unsent suffix that is a proper prefix of a stop string."""
        tail = self.text[self.sent:]
        for k in range(min(len(tail), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stops):
                return k
        return 0

    def flush(self):
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class Sampling:
    """Next-token choice from one row of logits: greedy at temperature 0 (or top_k 1), else
    softmax(logits / temperature) restricted to the top_k tokens and the top_p nucleus, drawn
    with a numpy Generator seeded by ``seed`` (None: fresh OS entropy)."""

    def __init__(self, temperature=0.0, top_k=0, top_p=1.0, seed=None):
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self):
        return self.temperature == 0.0 or self.top_k == 1

    def pick(self, logits):
        """Token id (int) from float logits [vocab]."""
        if self.greedy:
            return int(np.argmax(logits))
        x = np.asarray(logits, np.float64) / self.temperature
        if 0 < self.top_k < x.size:
            kth = np.partition(x, -self.top_k)[-self.top_k]
            x = np.where(x >= kth, x, -np.inf)
        p = np.exp(x - x.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            before = np.cumsum(p[order]) - p[order]  # mass of the more likely tokens
            cut = np.zeros_like(p)
            keep = order[before < self.top_p]
            cut[keep] = p[keep]
            p = cut / cut.sum()
        return int(min(np.searchsorted(np.cumsum(p), self.rng.random() * 1.0, side="right"), p.size - 1))

