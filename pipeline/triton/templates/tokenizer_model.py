"""Triton python-backend tokenizer model of an encoder: sentences -> token id tensors.

Written into ``<repo>/<model>/<version>/model.py`` by pipeline.triton.repository,
next to the encoder's tokenizer files (``tokenizer.json`` is loaded with the
``tokenizers`` library, with its own special tokens and post-processing, as the
export's tokenizer). Config parameters: ``max_length`` (longer sentences are
truncated), ``pad_id`` and ``pad_to_multiple_of``.

Per request: ``text`` [rows, 1] (UTF-8 strings) -> each configured output (the
encoder graph's inputs: ``input_ids``, ``attention_mask`` and, where the graph has
it, ``token_type_ids``) int64 [rows, length],
where ``length`` is the request's longest row rounded up to a multiple of
``pad_to_multiple_of`` (pad positions: ``pad_id``, mask 0, type 0). Equal
lengths across requests are what lets the compute model's dynamic batcher
put them into one batch. A request that fails gets an error response; the
others in the same call are unaffected.
"""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        folder = os.path.join(args["model_repository"], args["model_version"])
        self.tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=int(params["max_length"]))
        self.tokenizer.no_padding()
        self.pad_id = int(params["pad_id"])
        self.multiple = max(1, int(params["pad_to_multiple_of"]))
        self.output_names = [t["name"] for t in config["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._tokenize(request))
            except Exception as e:  # this request only
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tokenizer: {e}")))
        return responses

    def _tokenize(self, request):
        texts = pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)
        texts = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in texts]
        encodings = self.tokenizer.encode_batch(texts)
        longest = max(len(e.ids) for e in encodings)
        length = -(-longest // self.multiple) * self.multiple
        arrays = {
            "input_ids": np.full((len(texts), length), self.pad_id, np.int64),
            "attention_mask": np.zeros((len(texts), length), np.int64),
            "token_type_ids": np.zeros((len(texts), length), np.int64),
        }
        for row, e in enumerate(encodings):
            arrays["input_ids"][row, : len(e.ids)] = e.ids
            arrays["attention_mask"][row, : len(e.ids)] = e.attention_mask
            arrays["token_type_ids"][row, : len(e.ids)] = e.type_ids
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(n, arrays[n]) for n in self.output_names]
        )
