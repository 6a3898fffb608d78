"""Triton python-backend image preprocessing model: encoded images -> classifier input.

Written into ``<repo>/<model>/<version>/model.py`` (self-contained: it imports
only numpy, Pillow and Triton's ``triton_python_backend_utils``). Config
parameters (strings): ``height``, ``width`` (the graph input's H, W),
``mean``, ``std``, ``channel_order`` (``BGR`` or ``RGB``).

Per request: ``image`` [rows, 1] (PNG/JPEG bytes) -> the configured output
(the compute graph's input, e.g. ``x``) float32 [rows, 3, height, width]:
each image is resized to ``height`` keeping its aspect ratio (width at most
``width``, bilinear), scaled ``(pixel / 255 - mean) / std``, put in
``channel_order`` channels first, and padded on the right with zeros
(PaddleOCR's text-direction classifier normalisation,
``pipeline.models.image_classification.preprocess``). A request with an
undecodable image gets an error response naming its row; the others in the
same call are unaffected.
"""
import io
import json
import math

import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.height, self.width = int(params["height"]), int(params["width"])
        self.mean, self.std = float(params["mean"]), float(params["std"])
        self.bgr = params.get("channel_order", "BGR").upper() == "BGR"
        self.output_name = config["output"][0]["name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._preprocess(request))
            except Exception as e:  # this request only
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"preprocess: {e}")))
        return responses

    def _preprocess(self, request):
        blobs = pb_utils.get_input_tensor_by_name(request, "image").as_numpy().reshape(-1)
        batch = np.stack([self._normalize(self._decode(b, row)) for row, b in enumerate(blobs)])
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(self.output_name, batch)])

    def _decode(self, blob, row):
        try:
            with Image.open(io.BytesIO(bytes(blob))) as im:
                return im.convert("RGB")
        except Exception as e:
            raise ValueError(f"row {row}: not a PNG/JPEG image ({len(bytes(blob))} bytes): {e}") from None

    def _normalize(self, image):
        w = min(self.width, math.ceil(self.height * image.width / image.height))
        pixels = np.asarray(image.resize((w, self.height), Image.BILINEAR), np.float32)
        if self.bgr:
            pixels = pixels[:, :, ::-1]
        out = np.zeros((3, self.height, self.width), np.float32)
        out[:, :, :w] = (pixels.transpose(2, 0, 1) / 255.0 - self.mean) / self.std
        return out
