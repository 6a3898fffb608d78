"""The generic kind (``entry:`` models gated on agreement with FP32) on a user's plain-torch
convolutional network: real 8x8 digit images (scikit-learn's bundled copy of the UCI digits),
INT8, built end to end. The plain-torch transformer block is examples/custom-model
(tests/e2e/test_custom_model_example.py)."""
from __future__ import annotations

import textwrap

import numpy as np
import yaml

MODEL = '''
import torch
from torch import nn


class DigitNet(nn.Module):
    """pixels float32 [batch, 1, 8, 8] -> logits float32 [batch, 10]: two conv blocks, a head."""

    output_names = ("logits",)

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(32, 10)

    def forward(self, pixels):
        return self.head(self.features(pixels))


def make_model():
    torch.manual_seed(0)
    return DigitNet().eval(), {"pixels": torch.rand(2, 1, 8, 8)}
'''


def test_a_plain_torch_conv_network_builds_end_to_end(tmp_path):
    from sklearn.datasets import load_digits

    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL))
    images = load_digits().images.astype(np.float32)[:, None] / 16.0  # [1797, 1, 8, 8] in [0, 1]
    np.savez(tmp_path / "digits.npz", pixels=images[:384])
    data = lambda start, stop: {"type": "npz", "path": "digits.npz", "split": {"start": start, "stop": stop}}  # noqa: E731
    recipe = {
        "name": "digit-conv", "model": {"kind": "generic", "source": {"entry": "./model.py:make_model"}},
        "export": {"opset": 19, "dynamic_axes": {"pixels": {0: "batch"}}, "check_points": [{"batch": 1}, {"batch": 5}, {"batch": 16}]},
        "quantize": {"precision": "int8", "per_channel_weights": True,
                     "calibration": {"method": "max", "data": data(0, 128), "samples": 128, "batch_size": 16}},
        "build": {"profiles": [{"name": "default", "dims": {"batch": {"min": 1, "opt": 8, "max": 16}}}]},
        "validate": {"data": data(128, 384), "max_windows": 256, "batch_size": 16,
                     "gates": [{"metric": "mean_cosine", "min": 0.99}, {"metric": "top1_agreement", "min": 0.9}]},
        "triton": {"target": "auto", "model_name": "digit_conv_int8", "max_batch_size": 16},
        "work_dir": str(tmp_path / "artifacts"), "output_dir": str(tmp_path / "model_repository"),
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = run_pipeline(load_recipe(path), path, quiet=True)
    man = result.manifest
    assert result.passed, (man["gates"], man["metrics"])
    assert {k: v["status"] for k, v in man["stages"].items()} == {
        "export": "ok", "quantize": "ok", "build": man["stages"]["build"]["status"], "validate": "ok", "triton": "ok"}
    q = result.artifacts["quantize"]
    assert q.precision == "int8" and q.quantized_nodes  # the head's GEMM at least
    assert man["metrics"]["eval_samples"] == 256 and man["metrics"]["mean_cosine"] >= 0.99
    assert (tmp_path / "model_repository" / "digit_conv_int8" / "config.pbtxt").is_file()
