"""Error types and the exit codes CI relies on (one table, also in the README).

| code | meaning |
|---:|---|
| 0 | passed |
| 1 | an accuracy gate failed, or an accuracy budget is unreachable |
| 2 | bad input: the recipe, a ``--set`` value, a data or model file |
| 3 | internal error: a bug; the traceback is saved to ``error.log`` |
| 4 | environment: lock held, server failed to start, storage or network error,
      a published repository that fails verification |
| 130 | interrupted (Ctrl-C / SIGTERM) |

Every user-facing failure is a PipelineError whose message names the file,
field, input or node at fault and what would be valid.
"""

EXIT_PASSED = 0
EXIT_GATE_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_ENVIRONMENT = 4
EXIT_INTERRUPTED = 130


class PipelineError(Exception):
    """Base class: the CLI prints the message and exits with ``exit_code``."""

    exit_code = EXIT_BAD_INPUT


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

    exit_code = EXIT_GATE_FAILED


class EnvironmentFault(PipelineError):
    """The machine, not the input: a lock held, a server that does not start,
    storage or network errors, a published repository that fails verification."""

    exit_code = EXIT_ENVIRONMENT


class LockHeld(EnvironmentFault):
    """Another build of the same recipe holds the run lock."""


class RepositoryCorrupt(EnvironmentFault):
    """A published repository differs from its ``repository.json`` or is half-published."""


class InternalError(PipelineError):
    """A bug in the pipeline (an unexpected exception); the CLI saves the traceback."""

    exit_code = EXIT_INTERNAL
