"""The generation model's requests and responses.

Request (all inputs optional): exactly one of ``text_input`` (a raw completion
prompt, no chat template), ``messages`` (a JSON list of ``{"role", "content"}``
rendered with the chat template, ``add_generation_prompt`` true, tokenized
without added special tokens, as transformers' ``apply_chat_template`` does) or
``input_ids`` (token ids used as they are); ``max_tokens`` (>= 1, default
``default_max_tokens`` lowered to fit the context; with ``messages``, the room left in the
context); ``ignore_eos``; sampling
``temperature`` (0, the default: greedy), ``top_k`` (0: off), ``top_p`` (1:
off), ``seed`` (same seed, same logits -> same tokens), ``stop`` (stop
strings; one that holds a special token is matched against the text with special tokens kept,
which the text sent still leaves out); ``prompt_logprobs`` (INT32 [1], top count 0..20: score the prompt; the prefill
then requests the full ``logits`` and takes log-softmax at each position, and ``max_tokens``
may be 0 = prefill only); ``logprobs`` (INT32 [1], top count 0..20: each generated token's
log-probability under the raw logits). ``scheduler_stats`` true alone: one response whose
``text_output`` is the scheduler's JSON statistics (:meth:`TritonPythonModel.stats`).

Responses: one per token, ``text_output`` [1] (the new text, see
:class:`IncrementalDecoder`; text that may begin a stop string is held back
until it cannot) and ``token_ids`` [1]; the final one (flag
``TRITONSERVER_RESPONSE_COMPLETE_FINAL``) adds ``finish_reason`` [1] (``stop``:
an EOS token, not with ``ignore_eos``, or a stop string, whose text and what
follows are not sent; ``length``: ``max_tokens``) and ``detail`` [1]. Bad input
values -> one error response naming the input. A request is refused only when
prompt + ``max_tokens`` exceeds ``max_context`` (or needs more KV cache than the
whole budget). A cancelled request ends at its next step with the ``CANCELLED``
error and leaves the batch.
"""
import json
import math

import numpy as np
import triton_python_backend_utils as pb_utils

from .chat import parse_messages, render_chat
from .decoding import IncrementalDecoder, Sampling
from .sequence import Sequence

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Protocol:
    """The request and response side of :class:`~.model.TritonPythonModel` (a mixin: it reads the
    model's parameters, tokenizer and statistics from ``self``)."""

    def _sequence(self, request, sender):
        """A Sequence for ``request``; None when it was a ``scheduler_stats`` request (answered here).

        Raises:
            ValueError: an input with a bad value (the message names it), or a request that can
                never fit the context or the KV budget.
        """
        if self._one(request, "scheduler_stats", "b", "boolean (BOOL [1])"):
            sender.send(self._response(json.dumps(self.stats()), None, ("stats", "scheduler statistics")),
                        flags=FINAL)
            return None
        ids = self._prompt_ids(request)
        prompt_k = self._top_count(request, "prompt_logprobs")
        chat = pb_utils.get_input_tensor_by_name(request, "messages") is not None
        max_tokens = self._max_tokens(request, len(ids), scoring=prompt_k is not None, chat=chat)
        if len(ids) + max_tokens > self.budget_tokens:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) needs "
                             f"{(len(ids) + max_tokens) * self.token_bytes / 2**20:.2f} MiB of KV cache; the whole "
                             f"budget (triton.kv_cache_budget_mib) holds {self.budget_tokens} tokens")
        eos = set() if self._one(request, "ignore_eos", "b", "boolean (BOOL [1])") else self.eos
        stops = self._stop_strings(request)
        # a stop string holding a special token ('<|im_end|>') is matched against the text with special
        # tokens kept; the text sent still leaves them out
        keep = [t for t in self.special_texts if any(t in stop for stop in stops)]
        seq = Sequence(request, sender, ids, max_tokens, eos, self._sampling(request), stops,
                       IncrementalDecoder(self.tokenizer, skip_special_tokens=not keep, context=ids), prompt_k,
                       self._top_count(request, "logprobs"))
        seq.hide = self.special_texts if keep else []
        return seq

    def _top_count(self, request, name):
        """``prompt_logprobs`` / ``logprobs``: the top count (0..20), or None when absent."""
        value = self._one(request, name, "iu", "integer in [0, 20] (INT32 [1])")
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"{name} must be one integer in [0, 20] (the top count); got {value}")
        return value

    def _one(self, request, name, kinds, spec, default=None):
        """The single value of input ``name`` (numpy dtype kind in ``kinds``), or ``default`` if absent."""
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            return default
        values = np.asarray(tensor.as_numpy()).reshape(-1)
        if values.size != 1 or values.dtype.kind not in kinds:
            raise ValueError(f"{name} must be one {spec}; got {values.tolist()} of type {values.dtype}")
        return values[0].item()

    def _text(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            return None
        value = tensor.as_numpy().reshape(-1)[0]
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    def _prompt_ids(self, request):
        """Token ids from exactly one of ``input_ids``, ``text_input`` and ``messages``."""
        given = pb_utils.get_input_tensor_by_name(request, "input_ids")
        text, messages = self._text(request, "text_input"), self._text(request, "messages")
        if sum(x is not None for x in (given, text, messages)) != 1:
            raise ValueError("send exactly one of text_input (a raw prompt), messages (chat messages, JSON) "
                             "and input_ids (prompt token ids)")
        if given is not None:
            ids = [int(t) for t in given.as_numpy().reshape(-1)]
            if not ids or min(ids) < 0 or max(ids) >= self.vocab:
                raise ValueError(f"input_ids must be a non-empty list of ids in [0, {self.vocab})")
            return ids
        if messages is not None:
            if self.chat_template is None:
                raise ValueError("messages: this model's tokenizer has no chat template (chat_template.jinja or "
                                 "tokenizer_config.json chat_template); send text_input instead")
            text = render_chat(self.chat_template, parse_messages(messages), self.special)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            ids = self.tokenizer.encode(text).ids
        if not ids:
            raise ValueError(f"{'messages' if messages is not None else 'text_input'} tokenizes to no tokens")
        return ids

    def _max_tokens(self, request, prompt, scoring=False, chat=False):
        """``max_tokens`` (one integer >= 1; >= 0 when ``scoring`` the prompt), else
        ``default_max_tokens`` lowered to fit the context (a ``chat`` request: the room left in
        the context, as OpenAI's chat default).

        Raises:
            ValueError: a bad value, or prompt + max_tokens above ``max_context``.
        """
        limit = self.max_context
        value = self._one(request, "max_tokens", "iu", "integer >= 1 (INT32 [1])")
        if scoring and value == 0:
            if limit and prompt > limit:
                raise ValueError(f"prompt has {prompt} tokens; the context limit is {limit} tokens")
            return 0
        if value is None:
            if limit and prompt >= limit:
                raise ValueError(f"prompt has {prompt} tokens; the context limit is {limit} tokens "
                                 "(prompt + max_tokens)")
            if chat and limit:
                return limit - prompt
            return min(self.default_max_tokens, limit - prompt) if limit else self.default_max_tokens
        if value < 1:
            tensor = pb_utils.get_input_tensor_by_name(request, "max_tokens")
            values = np.asarray(tensor.as_numpy()).reshape(-1)
            raise ValueError(f"max_tokens must be one integer >= 1 (INT32 [1]); got {values.tolist()} "
                             f"of type {values.dtype}")
        if limit and prompt + value > limit:
            fix = f"lower max_tokens to at most {limit - prompt}" if prompt < limit else "shorten the prompt"
            raise ValueError(f"prompt ({prompt} tokens) + max_tokens ({value}) = {prompt + value} tokens exceeds the "
                             f"context limit of {limit} tokens; {fix}")
        return int(value)

    def _sampling(self, request):
        temperature = self._one(request, "temperature", "fiu", "number >= 0 (FP32 [1])", 0.0)
        top_k = self._one(request, "top_k", "iu", "integer >= 0 (INT32 [1])", 0)
        top_p = self._one(request, "top_p", "fiu", "number in (0, 1] (FP32 [1])", 1.0)
        seed = self._one(request, "seed", "iu", "integer >= 0 (INT64 [1])")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off); got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off); got {top_p}")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be an integer >= 0; got {seed}")
        return Sampling(temperature, top_k, top_p, seed)

    def _stop_strings(self, request):
        tensor = pb_utils.get_input_tensor_by_name(request, "stop")
        if tensor is None:
            return []
        stops = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in tensor.as_numpy().reshape(-1)]
        if not all(stops):
            raise ValueError(f"stop must be a list of non-empty strings (STRING [k]); got {stops}")
        return stops

    def _response(self, text, token, finish=None, scores=None):
        """One token's response; ``finish`` = (finish_reason, detail) on the final one; token None: no ids;
        ``scores``: the ``scores`` output's JSON object (none when empty)."""
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if scores:
            tensors.append(pb_utils.Tensor("scores", np.array([json.dumps(scores).encode()], dtype=np.object_)))
        if token is not None:
            tensors.append(pb_utils.Tensor("token_ids", np.array([token], dtype=np.int64)))
        if finish:
            tensors += [pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))
                        for name, value in zip(("finish_reason", "detail"), finish)]
        return pb_utils.InferenceResponse(output_tensors=tensors)
