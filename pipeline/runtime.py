"""ONNX Runtime sessions: CUDA when present, CPU otherwise."""
from __future__ import annotations

import onnxruntime as ort


def providers() -> list[str]:
    """CUDAExecutionProvider first when this onnxruntime build has it and a GPU answers."""
    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail and _usable(p)]


def _usable(provider: str) -> bool:
    if provider != "CUDAExecutionProvider":
        return True
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def ort_session(path: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(path, sess_options=opts, providers=providers())
