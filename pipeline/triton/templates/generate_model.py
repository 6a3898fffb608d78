"""Triton python-backend generation model (decoupled): prompt -> streamed greedy tokens.

Written into ``<repo>/<model>/<version>/model.py`` by pipeline.triton.repository,
next to the tokenizer files (``tokenizer.json`` is loaded with the
``tokenizers`` library). Every number comes from the config ``parameters``:
``compute_model``, ``num_layers``, ``kv_heads``, ``head_dim``, ``kv_dtype``,
``eos_token_ids`` (comma separated), ``default_max_tokens``, ``max_context``
and ``max_prompt_tokens`` (0 = unlimited), ``max_concurrent_generations``.

Concurrency: ``execute`` hands each request to a pool of
``max_concurrent_generations`` threads and returns at once (decoupled models
may answer after ``execute``), so generations interleave their compute-model
calls instead of queueing whole generations behind each other; requests past
that many wait in the pool's queue. :meth:`drain` waits for every accepted
request (``finalize`` calls it).

Per request: the prompt is ``text_input`` (one UTF-8 string, used as a plain
prompt, no chat template; tokenized here) or ``input_ids`` (token ids, used as
they are; exactly one of the two). A prefill call with empty past tensors
``[1, kv_heads, 0, head_dim]`` is followed by one-token decode steps that feed
``present.{i}.key/value`` back as ``past_key_values.{i}.key/value``, all
through the compute model via BLS. Each step takes the argmax of the last
logits (greedy) and streams one response: ``text_output`` [1] (the new text,
held back while it ends in an incomplete UTF-8 sequence) and ``token_ids`` [1].
Generation stops after ``max_tokens`` tokens (input, else
``default_max_tokens``), at an EOS token (streamed with empty text; not with
``ignore_eos`` true, which benchmarks use for fixed-length outputs), at
``max_context`` total tokens, or when the client cancels; the last response
carries ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``.
"""
import concurrent.futures
import json
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in config["parameters"].items()}
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

    def _generate(self, request, sender):
        ids = self._prompt_ids(request)
        budget = int(self._scalar(request, "max_tokens", self.default_max_tokens))
        stops = set() if self._scalar(request, "ignore_eos", False) else self.eos
        if self.max_prompt and len(ids) > self.max_prompt:
            raise ValueError(f"prompt has {len(ids)} tokens; this model accepts at most {self.max_prompt}")
        if self.max_context:
            budget = min(budget, self.max_context - len(ids) + 1)
        if budget <= 0:
            sender.send(flags=FINAL)
            return
        self._stream(request, sender, ids, budget, stops)

    def _stream(self, request, sender, ids, budget, stops):
        past = [np.zeros(self.past_shape, self.kv_dtype) for _ in self.past_names]
        step, total, generated, shown = ids, len(ids), [], ""
        while True:
            logits, past = self._forward(step, total, past)
            token = int(np.argmax(logits[0, -1]))
            generated.append(token)
            last = token in stops or len(generated) >= budget
            cancelled = hasattr(request, "is_cancelled") and request.is_cancelled()
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            delta = "" if (text.endswith("\ufffd") and not last) else text[len(shown):]
            shown += delta
            sender.send(self._response(delta, token), flags=FINAL if (last or cancelled) else 0)
            if last or cancelled:
                return
            step, total = [token], total + 1

    def _response(self, text, token):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("token_ids", np.array([token], dtype=np.int64)),
        ])

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
