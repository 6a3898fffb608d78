"""Triton python-backend generation model (decoupled): prompt -> streamed tokens, batched in flight.

Written into ``<repo>/<model>/<version>/served/`` (with :mod:`.entry` as ``<version>/model.py``) by
pipeline.models.text_generation.triton, next to the tokenizer files (``tokenizer.json`` is loaded with the
``tokenizers`` library; ``chat_template.jinja`` or tokenizer_config.json's
``chat_template`` formats ``messages``). Every number comes from the config
``parameters``: ``compute_model``, ``num_layers``, ``kv_heads``, ``head_dim``,
``kv_dtype``, ``eos_token_ids`` (comma separated), ``default_max_tokens``,
``max_context`` and ``max_prompt_tokens`` (0 = unlimited),
``max_concurrent_generations`` (the batch bound), ``continuous_batching``
(1/0), ``kv_cache_budget_mib`` (0 = the batch bound times ``max_context``),
``compute_runtime`` (``bls`` | ``onnxruntime``; with ``onnxruntime`` also
``compute_onnx``, ``graph_optimization_level``, ``dequantize_weights``, ``session_config``),
``logits_output`` (``last_logits`` [B, vocab] where the graph has it, else
``logits`` [B, n, vocab], of which the last position is used). Logits of ids past the
tokenizer's largest (a vocabulary padded past the tokenizer) are set to -inf: never sampled,
never among the top logprobs. The
folder is self-contained except that the in-process runtime imports the sibling
compute model's ``model.py`` (the python-onnxruntime template) for its
dequantize-once logic, rather than copying it.

Requests and responses: :mod:`.protocol`; scheduling: :mod:`.scheduler`; the KV cache: :mod:`.kv`.
"""
import collections
import concurrent.futures
import json
import math
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from .chat import load_chat_template, special_tokens
from .compute import BLSCompute, InProcessCompute
from .kv import KVCache
from .protocol import FINAL, Protocol
from .scheduler import Scheduler


class TritonPythonModel(Protocol, Scheduler, KVCache):
    """The model the python backend instantiates: one per model instance (:mod:`.protocol`,
    :mod:`.scheduler` and :mod:`.kv` hold its other methods)."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.model_name = config.get("name", "generate")
        self.compute_model = p["compute_model"]
        self.layers, self.kv_heads, self.head_dim = int(p["num_layers"]), int(p["kv_heads"]), int(p["head_dim"])
        self.kv_dtype = np.dtype(p["kv_dtype"])
        self.eos = {int(t) for t in p["eos_token_ids"].split(",") if t}
        self.default_max_tokens = int(p["default_max_tokens"])
        self.max_context = int(p["max_context"])
        self.max_prompt = int(p["max_prompt_tokens"])  # prefill chunk size (0: whole prompts)
        kinds = ("key", "value")
        self.past_names = [f"past_key_values.{i}.{k}" for i in range(self.layers) for k in kinds]
        self.present_names = [f"present.{i}.{k}" for i in range(self.layers) for k in kinds]
        folder = os.path.join(args["model_repository"], args["model_version"])
        self.tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        # ids the tokenizer has an entry for: 0 .. its largest id; a padded embedding's rows past it are masked
        self.token_ids = max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.chat_template, self.special = load_chat_template(folder), special_tokens(folder)
        added = self.tokenizer.get_added_tokens_decoder().values()
        self.special_texts = sorted({t.content for t in added if t.special}, key=len, reverse=True)
        self.logits_name = p.get("logits_output", "logits")  # last_logits [B, V] where the graph has it
        outputs = [self.logits_name, *self.present_names]
        self.runtime = p.get("compute_runtime", "bls")
        root = os.path.dirname(os.path.abspath(args["model_repository"]))
        if self.runtime == "onnxruntime" and not os.path.isfile(os.path.join(root, p.get("compute_onnx", ""))):
            # A repository in cloud storage is downloaded model by model into separate temporary
            # folders, so the sibling compute model's graph is not beside this one: use BLS.
            print(f"{args['model_name']}: compute graph not found beside this model ({root}); "
                  f"calling the compute model through BLS", flush=True)
            self.runtime = "bls"
        if self.runtime == "onnxruntime":
            self.compute = InProcessCompute(root, p, outputs)
        else:
            self.compute = BLSCompute(self.compute_model, outputs)
        self.max_batch = max(1, int(p.get("max_concurrent_generations", "1")))
        self.continuous = p.get("continuous_batching", "1") == "1"
        self.token_bytes = 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype.itemsize
        self.budget_tokens, budget = self._kv_budget(float(p.get("kv_cache_budget_mib", "0")))
        self.cond = threading.Condition()
        self.waiting, self.active, self.inflight = collections.deque(), [], set()
        self.reserved, self.stopping, self.turn = 0, False, 0
        self.histogram = collections.Counter()
        self.thread_state = threading.local()  # .last_step: (sequence ids, their lengths after it, mask,
        # present) of this thread's last step (the scheduler's, or each request thread's with batching off)
        self.stats_lock = threading.Lock()
        mode = "continuous batching on" if self.continuous else "continuous batching off (one thread per request)"
        self._log(f"{self.model_name}: {mode}; max batch {self.max_batch}; {budget}; compute: "
                  f"{'ONNX Runtime in this process' if self.runtime == 'onnxruntime' else 'BLS to ' + self.compute_model}")
        if self.continuous:
            self.thread = threading.Thread(target=self._loop, name=f"{self.model_name}-scheduler", daemon=True)
            self.thread.start()
        else:
            self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.max_batch, thread_name_prefix="generate")

    @staticmethod
    def _log(message):
        if hasattr(pb_utils, "Logger"):
            pb_utils.Logger.log_info(message)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                seq = self._sequence(request, sender)
            except Exception as e:  # a bad request: an error to its client, the others go on
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)
                continue
            if seq is None:
                continue
            with self.cond:
                self.inflight.add(seq)
                if self.continuous:
                    self.waiting.append(seq)
                    self.cond.notify_all()
            if not self.continuous:
                self.pool.submit(self._solo, seq)
        return None

    def drain(self, timeout=None):
        """Wait until every accepted request has sent its final response."""
        with self.cond:
            self.cond.wait_for(lambda: not self.inflight, timeout)

    def finalize(self):
        self._log(f"{self.model_name}: finalize: {len(self.inflight)} requests in flight")
        self.drain()
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.continuous:
            self.thread.join()
        else:
            self.pool.shutdown(wait=True)
        self._log(f"{self.model_name}: scheduler statistics {json.dumps(self.stats())}")

    def stats(self):
        """Scheduler statistics: ``executions_by_batch_size`` {batch size (str): compute calls},
        ``steps``, ``mean_batch``, ``max_batch``, ``continuous_batching``, ``kv_cache_budget_tokens``
        (None: unbounded), ``kv_bytes_per_token``, ``active``, ``queued`` (continuous batching's
        batch and queue), ``inflight`` (requests accepted and not yet answered in full, either mode)."""
        with self.stats_lock:
            histogram = dict(sorted(self.histogram.items()))
        steps = sum(histogram.values())
        return {
            "continuous_batching": self.continuous, "max_batch": self.max_batch,
            "kv_cache_budget_tokens": None if self.budget_tokens == math.inf else int(self.budget_tokens),
            "kv_bytes_per_token": self.token_bytes,
            "executions_by_batch_size": {str(b): n for b, n in histogram.items()}, "steps": steps,
            "mean_batch": sum(b * n for b, n in histogram.items()) / steps if steps else 0.0,
            "active": len(self.active), "queued": len(self.waiting), "inflight": len(self.inflight),
        }
