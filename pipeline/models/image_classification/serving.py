"""Triton models of the image-classification kind beside the compute model.

* ``<model>_preprocess`` (python backend, ``preprocess_model.py``): ``image``
  TYPE_STRING [1] (PNG/JPEG bytes per row) -> the graph input (e.g. ``x``)
  TYPE_FP32 [3, height, width];
* ``<model>_ensemble``: ``image`` -> preprocess -> compute -> the compute
  model's outputs (class probabilities), names and types unchanged.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tritonclient.grpc import model_config_pb2 as mc

from pipeline.artifacts import TensorSpec
from pipeline.errors import TritonConfigError
from pipeline.models.image_classification.preprocess import HEIGHT, MEAN, STD, WIDTH

if TYPE_CHECKING:  # protobuf message classes have no stubs here
    ModelConfig = Any
else:
    ModelConfig = mc.ModelConfig
IMAGE_INPUT = "image"
TEMPLATE = "preprocess_model.py"


def preprocess_model_name(model_name: str) -> str:
    """Name of the preprocessing model of compute model ``model_name``."""
    return f"{model_name}_preprocess"


def ensemble_model_name(model_name: str) -> str:
    """Name of the image -> class-probabilities ensemble of ``model_name``."""
    return f"{model_name}_ensemble"


def preprocess_config(name: str, *, max_batch_size: int, output: str, height: int = HEIGHT, width: int = WIDTH,
                      mean: float = MEAN, std: float = STD, channel_order: str = "BGR") -> ModelConfig:
    """Config of the python-backend preprocessing model.

    I/O (batched): ``image`` TYPE_STRING [1] -> ``output`` TYPE_FP32 [3, height, width].
    Parameters (strings): ``height``, ``width`` (pixels), ``mean``, ``std``, ``channel_order``.

    Raises:
        TritonConfigError: ``max_batch_size`` < 1, a non-positive size or std,
            or a channel order other than BGR / RGB.
    """
    if max_batch_size < 1 or height < 1 or width < 1 or std <= 0 or channel_order not in ("BGR", "RGB"):
        raise TritonConfigError(f"model '{name}': preprocessing needs max_batch_size >= 1, positive height/width/"
                                f"std and channel_order BGR or RGB; got max_batch_size {max_batch_size}, "
                                f"{height}x{width}, std {std}, {channel_order!r}")
    cfg = ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    cfg.input.add(name=IMAGE_INPUT, data_type=mc.TYPE_STRING, dims=[1])
    cfg.output.add(name=output, data_type=mc.TYPE_FP32, dims=[3, height, width])
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    params = {"height": height, "width": width, "mean": mean, "std": std, "channel_order": channel_order}
    for key, value in params.items():
        cfg.parameters[key].string_value = str(value)
    return cfg


def ensemble_config(name: str, preprocess: ModelConfig, compute: ModelConfig) -> ModelConfig:
    """Ensemble ``image`` -> ``preprocess`` -> ``compute`` -> the compute model's outputs.

    Raises:
        TritonConfigError: the preprocessing output is not an input of the compute model.
    """
    tensor = preprocess.output[0].name
    if tensor not in {t.name for t in compute.input}:
        raise TritonConfigError(f"model '{name}': preprocessing output '{tensor}' is not an input of "
                                f"'{compute.name}' (inputs {[t.name for t in compute.input]})")
    cfg = ModelConfig(name=name, platform="ensemble", max_batch_size=compute.max_batch_size)
    cfg.input.add(name=IMAGE_INPUT, data_type=mc.TYPE_STRING, dims=[1])
    for out in compute.output:
        cfg.output.add(name=out.name, data_type=out.data_type, dims=list(out.dims))
    first = cfg.ensemble_scheduling.step.add(model_name=preprocess.name, model_version=-1)
    first.input_map[IMAGE_INPUT] = IMAGE_INPUT
    first.output_map[tensor] = tensor
    second = cfg.ensemble_scheduling.step.add(model_name=compute.name, model_version=-1)
    second.input_map[tensor] = tensor
    for out in compute.output:
        second.output_map[out.name] = out.name
    return cfg


def graph_image_size(inputs: list[TensorSpec]) -> tuple[str, int, int]:
    """``(input name, height, width)`` the preprocessing must produce: the graph's one
    4-D input; a symbolic H or W takes the classifier's 48 x 192.

    Raises:
        TritonConfigError: the graph has not exactly one ``[batch, 3, H, W]`` input.
    """
    if len(inputs) != 1 or len(inputs[0].shape) != 4 or inputs[0].shape[1] != 3:
        raise TritonConfigError(f"image classifier graph inputs {[(s.name, s.shape) for s in inputs]}: valid: "
                                f"one [batch, 3, height, width] input")
    _, _, h, w = inputs[0].shape
    return inputs[0].name, (h if isinstance(h, int) and h > 0 else HEIGHT), (w if isinstance(w, int) and w > 0 else WIDTH)


def stage(compute: Any, version: int, max_batch_size: int, staging: Path) -> list[Any]:
    """Write the preprocessing model (template + config) and the ensemble into ``staging``.

    Args:
        compute: the staged compute model (``pipeline.triton.repository.StagedModel``).

    Returns:
        ``[preprocess, ensemble]`` as StagedModels, for the repository checks.

    Raises:
        TritonConfigError: as :func:`graph_image_size` and :func:`preprocess_config`.
    """
    from pipeline.triton.config import check_ensemble, to_text
    from pipeline.triton.repository import StagedModel

    name, height, width = graph_image_size(compute.inputs)
    model = compute.config.name
    pre = preprocess_config(preprocess_model_name(model), max_batch_size=max_batch_size, output=name,
                            height=height, width=width)
    ens = ensemble_config(ensemble_model_name(model), pre, compute.config)
    check_ensemble(ens, {m.name: m for m in (pre, compute.config)})
    (staging / pre.name / str(version)).mkdir(parents=True)
    (staging / pre.name / str(version) / "model.py").write_text(
        (resources.files("pipeline.models.image_classification") / TEMPLATE).read_text())
    (staging / ens.name / str(version)).mkdir(parents=True)
    for cfg in (pre, ens):
        (staging / cfg.name / "config.pbtxt").write_text(to_text(cfg))
    image = [TensorSpec(IMAGE_INPUT, "object", ["batch", 1])]
    pixels = [TensorSpec(name, "float32", ["batch", 3, height, width])]
    return [StagedModel(pre, image, pixels, "python", None), StagedModel(ens, image, compute.outputs, "ensemble", None)]
