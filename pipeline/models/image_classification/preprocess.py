"""PaddleOCR text-direction classifier input: a text-line crop -> ``[3, 48, 192]`` float32.

The normalisation of PaddleOCR's ``TextClassifier.resize_norm_img`` (the cls
model of ``rapidocr-onnxruntime``, ``cls_image_shape: [3, 48, 192]``):

1. resize to height ``H`` = 48 keeping the aspect ratio, width
   ``min(W, ceil(H * w / h))`` with ``W`` = 192 (bilinear; longer lines are squeezed);
2. ``(pixel / 255 - 0.5) / 0.5`` in [-1, 1], channels first, in BGR order (the
   model was trained on OpenCV-decoded images);
3. pad on the right with zeros to width ``W``.

The Triton preprocessing model (``preprocess_model.py``) repeats these steps
on its own (the model repository is self-contained); a test holds both equal.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

HEIGHT = 48
WIDTH = 192
MEAN = 0.5
STD = 0.5


def resized_width(width: int, height: int, target_h: int = HEIGHT, target_w: int = WIDTH) -> int:
    """Width in pixels after the aspect-preserving resize to ``target_h`` (at most ``target_w``).

    Raises:
        ValueError: a non-positive image size.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size {width}x{height}: valid sizes are positive")
    return min(target_w, math.ceil(target_h * width / height))


def normalize(image, target_h: int = HEIGHT, target_w: int = WIDTH) -> np.ndarray:
    """One image (a ``PIL.Image.Image``, any mode) -> float32 ``[3, target_h, target_w]``.

    Raises:
        ValueError: the image has a zero size.
    """
    from PIL import Image

    rgb = image.convert("RGB")
    w = resized_width(rgb.width, rgb.height, target_h, target_w)
    pixels = np.asarray(rgb.resize((w, target_h), Image.Resampling.BILINEAR), np.float32)[:, :, ::-1]  # RGB -> BGR
    out = np.zeros((3, target_h, target_w), np.float32)
    out[:, :, :w] = (pixels.transpose(2, 0, 1) / 255.0 - MEAN) / STD
    return out


def decode(data: bytes):
    """PNG/JPEG bytes -> RGB ``PIL.Image.Image``.

    Raises:
        ValueError: the bytes are not an image Pillow can decode.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"not a PNG/JPEG image ({len(data)} bytes): {e}") from None


def batch(images: Iterable, target_h: int = HEIGHT, target_w: int = WIDTH) -> np.ndarray:
    """Images -> the graph input, float32 ``[n, 3, target_h, target_w]``.

    Raises:
        ValueError: no image, or an image with a zero size.
    """
    arrays = [normalize(im, target_h, target_w) for im in images]
    if not arrays:
        raise ValueError("no images to preprocess")
    return np.stack(arrays)


PROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class ImageProcessor:
    """The kind's processor (``LoadedModel.processor``): this normalisation's settings.
    The export stage saves it beside the graph (``export/tokenizer/preprocessor_config.json``)."""

    height: int = HEIGHT
    width: int = WIDTH
    mean: float = MEAN
    std: float = STD
    channel_order: str = "BGR"

    def __call__(self, images: Iterable) -> np.ndarray:
        """Images -> float32 ``[n, 3, height, width]`` (:func:`batch`; RGB order when configured).

        Raises:
            ValueError: no image, or an image with a zero size.
        """
        x = batch(images, self.height, self.width)
        if self.channel_order == "RGB":
            x = np.ascontiguousarray(x[:, ::-1])
        if (self.mean, self.std) != (MEAN, STD):
            x = ((x * STD + MEAN) - self.mean) / self.std
        return x.astype(np.float32)

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write ``folder/preprocessor_config.json`` (the settings, plus ``resize``) and return its path."""
        path = Path(folder) / PROCESSOR_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**asdict(self), "resize": "keep aspect to height, bilinear, pad right with 0"},
                                   indent=1) + "\n")
        return path
