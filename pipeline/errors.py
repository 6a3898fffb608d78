"""Error types. Every user-facing failure is a PipelineError with a message
that names the file, field, input or node at fault and what would be valid."""


class PipelineError(Exception):
    """Base class: the CLI prints the message and exits with ``exit_code``."""

    exit_code = 2


class RecipeError(PipelineError):
    """The recipe file is missing or breaks the schema."""


class ExportError(PipelineError):
    """Export failed, or the exported graph is not dynamic where it must be."""


class QuantizationError(PipelineError):
    """Q/DQ placement or calibration failed (bad exclusions, too little data)."""


class GraphCheckError(PipelineError):
    """A graph handed to TensorRT breaks a rule TensorRT enforces."""


class ProfileError(PipelineError):
    """Optimization profiles do not fit the graph's inputs."""


class TritonConfigError(PipelineError):
    """A generated config.pbtxt does not agree with the model it serves."""


class AccuracyError(PipelineError):
    """A comparison cannot be trusted (NaN in the reference, nothing compared)."""


class GateFailed(PipelineError):
    """An accuracy gate failed; the report says which metric and by how much."""

    exit_code = 1
