"""The generation model's scheduler.

Scheduling (``continuous_batching`` 1): ``execute`` queues each request and
returns (decoupled models answer later). One scheduler thread per model
instance admits queued requests between steps (FIFO, while fewer than
``max_concurrent_generations`` are active and their KV reservations, prompt +
``max_tokens`` tokens each, fit the budget) and runs steps. A step is one
compute call over the active sequences that need the same kind of work: every
decoding sequence's next token, or one prefill chunk (the same token count for
each prefilling sequence, at most ``max_prompt_tokens``; longer prompts take
several chunks); when both wait the two kinds alternate. New tokens are never
padded: only the past is, on the left, to the longest past of the batch, with
``attention_mask`` 0 over the padding (the exported graph derives position
ids from the mask's cumulative sum, so positions stay right). Each sequence
keeps its own KV (preallocated [kv_heads, prompt + max_tokens, head_dim] per
layer) and receives its new entries after the step; while the batch stays the same, a step's
present tensors are the next step's past as they are (no gather), and the in-process runtime
writes them into two reused buffer sets per thread (:class:`OutputBuffers`). Finished, failed and
cancelled sequences leave at once. When a batched call fails, its sequences are
retried one at a time so only the failing ones get an error. With
``continuous_batching`` 0 each request decodes alone on one of
``max_concurrent_generations`` threads (the same steps with a batch of one).
"""
import triton_python_backend_utils as pb_utils

from .protocol import FINAL
from .scoring import log_softmax, top_logprobs


class Scheduler:
    """The scheduling side of :class:`~.model.TritonPythonModel` (a mixin: the queue, the batch and
    the lock are the model's)."""

    def _loop(self):
        """The scheduler: admit, pick the step's sequences, run the step; until finalize."""
        while True:
            self._drop_cancelled()  # before admission: a cancelled request's slot is refilled at once
            with self.cond:
                self._admit()
                if not self.active:
                    if self.stopping:
                        return
                    self.cond.wait()
                    continue
                batch = self._pick()
            try:
                self._run(batch, self._chunk(batch))
            except Exception as e:  # a bug must not stop the loop: fail this step's requests only
                for seq in batch:
                    if not seq.done:
                        self._fail(seq, f"generation failed: {type(e).__name__}: {e}")

    def _admit(self):
        """Move queued sequences into the batch while the batch bound and the KV budget allow (lock held)."""
        while (self.waiting and len(self.active) < self.max_batch
               and self.reserved + self.waiting[0].capacity <= self.budget_tokens):
            seq = self.waiting.popleft()
            seq.kv = self._allocate(seq)
            self.active.append(seq)
            self.reserved += seq.capacity

    def _pick(self):
        """This step's sequences: every decoding one or every prefilling one, alternating when both wait."""
        decode = [s for s in self.active if not s.prefilling]
        prefill = [s for s in self.active if s.prefilling]
        if decode and prefill:
            self.turn ^= 1
            return prefill if self.turn else decode
        return decode or prefill

    def _drop_cancelled(self):
        """Cancelled sequences, active or queued, get the CANCELLED error and leave."""
        with self.cond:
            candidates = [*self.active, *self.waiting]
        gone = [s for s in candidates if s.cancelled()]
        with self.cond:
            for seq in gone:
                if seq in self.waiting:
                    self.waiting.remove(seq)
        for seq in gone:
            self._cancel(seq)

    def _solo(self, seq):
        """continuous_batching off: one request's whole generation on this thread."""
        try:
            seq.kv = self._allocate(seq)
            while not seq.done:
                if seq.cancelled():
                    self._cancel(seq)
                else:
                    self._run([seq], self._chunk([seq]))
        except Exception as e:  # report to this client, keep serving others
            self._fail(seq, str(e))

    def _chunk(self, seqs):
        """New tokens per sequence this step: the fewest pending, within the prompt and context limits."""
        n = min(len(s.pending) for s in seqs)
        if self.max_prompt:
            n = min(n, self.max_prompt)
        if self.max_context:
            n = min(n, self.max_context - max(s.length for s in seqs))
        return max(n, 1)

    #: a sequence whose prompt is scored runs its steps alone (see :meth:`_run`); the scheduler tests turn
    #: it off to check that batched steps give the same numbers on causal test graphs
    score_alone = True

    def _run(self, seqs, n):
        """One step: a compute call feeding ``n`` tokens of each sequence, then each samples and streams.
        A sequence whose prompt is being scored runs its step alone: its log-probabilities are then those
        of the prefill it gets alone. Batched, a row's past is left-padded to the batch's longest, which
        shifts its keys within ONNX Runtime's vectorized Softmax sum: when the shift is not a multiple of
        the kernel's vector width (8 floats on
        the AVX-512 machine measured; ONNX Runtime picks the kernel by CPU) about 30 % of the probabilities move
        by one float32 ulp, and an FP8 Q/DQ downstream can round such a value to the neighbouring FP8
        step. On the served FP8 SmolLM2 one of 40 lm-eval continuations moved by 0.15 nats that way (39
        bit-identical); the size of the effect depends on the CPU, so scores are computed alone
        (docs/serving.md, benchmarks/softmax_padding.py)."""
        if self.score_alone and len(seqs) > 1 and any(s.scoring for s in seqs):
            for seq in seqs:
                self._run([seq], self._chunk([seq]))
            return
        try:
            last = self._forward(seqs, n)
        except Exception as e:
            if len(seqs) > 1:  # find the failing sequence(s): retry one by one
                for seq in seqs:
                    self._run([seq], n)
            else:
                self._fail(seqs[0], f"{self.compute_model}: {e}")
            return
        for seq, logits in zip(seqs, last):
            if not seq.pending:
                try:
                    self._emit(seq, logits)
                except Exception as e:  # e.g. the sender failed: this request only
                    self._fail(seq, str(e))

    def _emit(self, seq, logits):
        """Sample the next token, stream it, and end the sequence when it finishes (with
        ``max_tokens`` 0: send the prompt's logprobs and end)."""
        scores = {"prompt": seq.prompt_logprobs()} if seq.prompt_k is not None and not seq.generated else {}
        if seq.max_tokens == 0:
            finish = ("length", "max_tokens 0: the prompt was scored, nothing generated")
            seq.sender.send(self._response("", None, finish, scores), flags=FINAL)
            self._leave(seq)
            return
        token = seq.sampling.pick(logits)
        if seq.gen_k is not None:
            row = log_softmax(logits)
            scores["token"] = {"logprob": float(row[token]), "top": top_logprobs(row, seq.gen_k)}
        seq.generated += 1
        finish = self._finish(token, seq)
        text, hit = seq.stopper.add(seq.decoder.add(token))
        if finish and hit is None:
            tail, hit = seq.stopper.add(seq.decoder.flush())
            text += tail if hit is not None else tail + seq.stopper.flush()
        if hit is not None:
            finish = ("stop", f"stop string {hit!r}")
        for special in seq.hide:
            text = text.replace(special, "")
        if finish:
            seq.sender.send(self._response(text, token, finish, scores), flags=FINAL)
            self._leave(seq)
            return
        seq.pending = [token]
        seq.sender.send(self._response(text, token, None, scores), flags=0)

    def _finish(self, token, seq):
        """(finish_reason, detail) once ``token`` ends the sequence, else None."""
        if token in seq.eos:
            return "stop", f"EOS token {token}"
        if seq.generated >= seq.max_tokens:
            return "length", f"max_tokens {seq.max_tokens} reached"
        prompt = len(seq.prompt)
        if self.max_context and prompt + seq.generated > self.max_context:  # no room to feed the token back
            return "length", (f"context limit {self.max_context} tokens reached "
                              f"(prompt {prompt} tokens, {seq.generated} generated)")
        return None

    def _leave(self, seq):
        with self.cond:
            if seq in self.active:
                self.active.remove(seq)
                self.reserved -= seq.capacity
            self.inflight.discard(seq)
            seq.done, seq.kv = True, None
            self.cond.notify_all()

    def _cancel(self, seq):
        """The documented pattern: a final response holding the CANCELLED error."""
        message = f"request cancelled by the client after {seq.generated} generated tokens"
        self._log(f"{self.model_name}: {message}")
        error = pb_utils.TritonError(message, pb_utils.TritonError.CANCELLED)
        self._final_error(seq, error)

    def _fail(self, seq, message):
        self._final_error(seq, pb_utils.TritonError(message))

    def _final_error(self, seq, error):
        try:
            seq.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        except Exception as e:  # the client is gone; the sequence leaves all the same
            self._log(f"{self.model_name}: could not send the final error ({error}): {e}")
        self._leave(seq)
