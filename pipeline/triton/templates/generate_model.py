"""Triton python-backend generation model (decoupled): prompt -> streamed greedy tokens.

Written into ``<repo>/<model>/<version>/model.py`` by pipeline.triton.repository,
next to the tokenizer files (``tokenizer.json`` is loaded with the
``tokenizers`` library). Every number comes from the config ``parameters``:
``compute_model``, ``num_layers``, ``kv_heads``, ``head_dim``, ``kv_dtype``,
``eos_token_ids`` (comma separated), ``default_max_tokens``, ``max_context``
and ``max_prompt_tokens`` (0 = unlimited), ``max_concurrent_generations``.
The file is self-contained: the python backend loads it alone.

Concurrency: ``execute`` hands each request to a pool of
``max_concurrent_generations`` threads and returns at once (decoupled models
may answer after ``execute``), so generations interleave their compute-model
calls instead of queueing whole generations behind each other; requests past
that many wait in the pool's queue. :meth:`drain` waits for every accepted
request (``finalize`` calls it).

Per request: the prompt is ``text_input`` (one UTF-8 string, used as a plain
prompt, no chat template; tokenized here) or ``input_ids`` (token ids, used as
they are; exactly one of the two); ``max_tokens`` (an integer >= 1, else an
error response; default ``default_max_tokens``). A prefill call with empty past
tensors ``[1, kv_heads, 0, head_dim]`` is followed by one-token decode steps
that feed ``present.{i}.key/value`` back as ``past_key_values.{i}.key/value``,
all through the compute model via BLS. Each step takes the argmax of the last
logits (greedy) and streams one response: ``text_output`` [1] (the new text,
see :class:`IncrementalDecoder`) and ``token_ids`` [1].

The last token's response carries ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` and
``finish_reason`` [1]: ``stop`` (an EOS token; not with ``ignore_eos`` true,
which benchmarks use for fixed-length outputs) or ``length`` (``max_tokens``
tokens, or the context limit ``max_context``), with ``detail`` [1] saying which.
A prompt longer than ``max_prompt_tokens`` or ``max_context`` gets an error
response. A request the client cancels ends, at the next step, with the
``CANCELLED`` error as its final response and frees its thread.
"""
import concurrent.futures
import json
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


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
    """

    def __init__(self, tokenizer, skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = []
        self.prefix = self.read = 0

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


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.model_name = config.get("name", "generate")
        self.compute_model = p["compute_model"]
        layers = int(p["num_layers"])
        self.past_shape = (1, int(p["kv_heads"]), 0, int(p["head_dim"]))
        self.kv_dtype = np.dtype(p["kv_dtype"])
        self.eos = {int(t) for t in p["eos_token_ids"].split(",") if t}
        self.default_max_tokens = int(p["default_max_tokens"])
        self.max_context = int(p["max_context"])
        self.max_prompt = int(p["max_prompt_tokens"])
        kinds = ("key", "value")
        self.past_names = [f"past_key_values.{i}.{k}" for i in range(layers) for k in kinds]
        self.present_names = [f"present.{i}.{k}" for i in range(layers) for k in kinds]
        folder = os.path.join(args["model_repository"], args["model_version"])
        self.tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.memory = {}
        if hasattr(pb_utils, "PreferredMemory"):  # BLS outputs on CPU even from a GPU model
            self.memory = {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)}
        workers = max(1, int(p.get("max_concurrent_generations", "1")))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="generate")
        self.inflight = set()
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            future = self.pool.submit(self._serve, request, request.get_response_sender())
            with self.lock:
                self.inflight.add(future)
            future.add_done_callback(self._done)
        return None

    def _done(self, future):
        with self.lock:
            self.inflight.discard(future)

    def drain(self, timeout=None):
        """Wait until every accepted request has sent its final response."""
        with self.lock:
            pending = list(self.inflight)
        concurrent.futures.wait(pending, timeout=timeout)

    def finalize(self):
        self.drain()
        self.pool.shutdown(wait=True)

    def _serve(self, request, sender):
        try:
            self._generate(request, sender)
        except Exception as e:  # report to this client, keep serving others
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)

    def _prompt_ids(self, request):
        """Token ids from ``input_ids`` or the tokenized ``text_input`` (exactly one given)."""
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        given = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if (text is None) == (given is None):
            raise ValueError("send exactly one of text_input (a prompt) and input_ids (prompt token ids)")
        if given is not None:
            ids = [int(t) for t in given.as_numpy().reshape(-1)]
            vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
            if not ids or min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"input_ids must be a non-empty list of ids in [0, {vocab})")
            return ids
        prompt = text.as_numpy().reshape(-1)[0]
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        ids = self.tokenizer.encode(prompt).ids
        if not ids:
            raise ValueError("text_input tokenizes to no tokens")
        return ids

    def _scalar(self, request, name, default):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return default if tensor is None else tensor.as_numpy().reshape(-1)[0].item()

    def _max_tokens(self, request):
        """``max_tokens`` (one integer >= 1), else ``default_max_tokens``."""
        tensor = pb_utils.get_input_tensor_by_name(request, "max_tokens")
        if tensor is None:
            return self.default_max_tokens
        values = np.asarray(tensor.as_numpy()).reshape(-1)
        if values.size != 1 or not np.issubdtype(values.dtype, np.integer) or values[0] < 1:
            raise ValueError(f"max_tokens must be one integer >= 1 (INT32 [1]); got {values.tolist()} "
                             f"of type {values.dtype}")
        return int(values[0])

    def _generate(self, request, sender):
        ids = self._prompt_ids(request)
        max_tokens = self._max_tokens(request)
        stops = set() if self._scalar(request, "ignore_eos", False) else self.eos
        if self.max_prompt and len(ids) > self.max_prompt:
            raise ValueError(f"prompt has {len(ids)} tokens; this model accepts at most {self.max_prompt}")
        if self.max_context and len(ids) > self.max_context:
            raise ValueError(f"prompt has {len(ids)} tokens; the context limit is {self.max_context} tokens")
        self._stream(request, sender, ids, max_tokens, stops)

    def _finish(self, token, generated, prompt, max_tokens, stops):
        """(finish_reason, detail) once ``generated`` tokens end the request, else None."""
        if token in stops:
            return "stop", f"EOS token {token}"
        if generated >= max_tokens:
            return "length", f"max_tokens {max_tokens} reached"
        if self.max_context and prompt + generated > self.max_context:  # no room to feed the token back
            return "length", (f"context limit {self.max_context} tokens reached "
                              f"(prompt {prompt} tokens, {generated} generated)")
        return None

    def _stream(self, request, sender, ids, max_tokens, stops):
        past = [np.zeros(self.past_shape, self.kv_dtype) for _ in self.past_names]
        step, total, generated = ids, len(ids), 0
        decoder = IncrementalDecoder(self.tokenizer)
        while True:
            if hasattr(request, "is_cancelled") and request.is_cancelled():
                self._cancelled(sender, generated)
                return
            logits, past = self._forward(step, total, past)
            token = int(np.argmax(logits[0, -1]))
            generated += 1
            finish = self._finish(token, generated, len(ids), max_tokens, stops)
            text = decoder.add(token)
            if finish:
                sender.send(self._response(text + decoder.flush(), token, finish), flags=FINAL)
                return
            sender.send(self._response(text, token), flags=0)
            step, total = [token], total + 1

    def _cancelled(self, sender, generated):
        """The documented pattern: a final response holding the CANCELLED error."""
        message = f"request cancelled by the client after {generated} generated tokens"
        if hasattr(pb_utils, "Logger"):
            pb_utils.Logger.log_info(f"{self.model_name}: {message}")
        error = pb_utils.TritonError(message, pb_utils.TritonError.CANCELLED)
        sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def _response(self, text, token, finish=None):
        """One token's response; ``finish`` = (finish_reason, detail) on the final one."""
        tensors = [
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("token_ids", np.array([token], dtype=np.int64)),
        ]
        if finish:
            tensors += [pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))
                        for name, value in zip(("finish_reason", "detail"), finish)]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _forward(self, step, total, past):
        """One compute-model call: logits [1, len(step), vocab] and the new past."""
        inputs = [
            pb_utils.Tensor("input_ids", np.array([step], dtype=np.int64)),
            pb_utils.Tensor("attention_mask", np.ones((1, total), dtype=np.int64)),
        ] + [pb_utils.Tensor(n, a) for n, a in zip(self.past_names, past)]
        response = pb_utils.InferenceRequest(
            model_name=self.compute_model,
            requested_output_names=["logits", *self.present_names],
            inputs=inputs,
            **self.memory,
        ).exec()
        if response.has_error():
            raise RuntimeError(f"{self.compute_model}: {response.error().message()}")
        logits = pb_utils.get_output_tensor_by_name(response, "logits").as_numpy()
        return logits, [pb_utils.get_output_tensor_by_name(response, n).as_numpy() for n in self.present_names]
