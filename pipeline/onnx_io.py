"""The one place ONNX files are written and checked.

* :func:`save_model_atomic` and :func:`replacing` write into a fresh temporary
  folder beside the target and ``os.replace`` the files into place, so a file
  already at the target (which the triton stage may have hard-linked into a
  published repository) is never rewritten: the new file gets a new inode.
* Models at or above the protobuf limit (2 GiB) are saved with their tensors in
  ``<name>.data`` beside the graph (ONNX external data). The limit can be
  lowered with ``PIPELINE_EXTERNAL_DATA_THRESHOLD`` (bytes), so tests take that
  path with a tiny model.
* A model may be loaded lazily (``onnx.load(..., load_external_data=False)``):
  tensors still on disk are read one at a time while saving (``base_dir``), so
  a large model is never held in memory twice.
* :func:`check_loadable` says whether a file on disk can be loaded: it parses,
  and every external-data file exists inside its folder and is long enough.
* Every graph written here is stripped of what records the machine rather than
  the graph (:func:`strip_machine_metadata`: the exporter's per-node Python
  stack traces, with absolute paths of the checkout and the venv), so the same
  build in two folders or on two machines writes the same bytes.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING
from pathlib import Path

import onnx
from onnx import TensorProto, external_data_helper as edh

from pipeline.errors import EnvironmentFault, PipelineError
from pipeline.faults import fault_point
from pipeline.fsutil import scratch_prefix

if TYPE_CHECKING:
    import numpy as np
    from pipeline.artifacts import TensorSpec

PROTOBUF_LIMIT = 2**31  # bytes; protobuf cannot serialize a message this large
THRESHOLD_ENV = "PIPELINE_EXTERNAL_DATA_THRESHOLD"
DATA_SUFFIX = ".data"
MIN_EXTERNAL_TENSOR = 1024  # bytes; smaller tensors stay inline (onnx's own default)
#: Metadata keys whose values depend on where the graph was built, not on the graph:
#: torch's dynamo exporter records each node's Python stack trace, absolute paths included.
#: (``pkg.torch.onnx.name_scopes`` is kept: the quantize stage matches exclusions on it.)
MACHINE_METADATA_KEYS = frozenset({"pkg.torch.onnx.stack_trace"})
#: bits per element of the packed (sub-byte) element types, by ONNX type name (newer onnx has more)
_PACKED_BITS = {"INT4": 4, "UINT4": 4, "FLOAT4E2M1": 4, "INT2": 2, "UINT2": 2, "FLOAT6E2M3": 6, "FLOAT6E3M2": 6}
_PACKED = {getattr(TensorProto, name): bits for name, bits in _PACKED_BITS.items() if hasattr(TensorProto, name)}


def external_data_threshold() -> int:
    """Model size (bytes) from which tensors go to an external data file.

    ``PIPELINE_EXTERNAL_DATA_THRESHOLD`` when set, else :data:`PROTOBUF_LIMIT`.

    Raises:
        PipelineError: the variable is not a non-negative integer.
    """
    raw = os.environ.get(THRESHOLD_ENV, "").strip()
    if not raw:
        return PROTOBUF_LIMIT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise PipelineError(f"environment variable {THRESHOLD_ENV}={raw!r}: expected a number of bytes >= 0")
    return min(value, PROTOBUF_LIMIT)


def data_file_name(path: str | Path) -> str:
    """Name of the external data file saved beside ``path``: ``<name>.data``."""
    return Path(path).name + DATA_SUFFIX


def tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Initializers and attribute tensors of the model, subgraphs included."""
    yield from _graph_tensors(model.graph)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _graph_tensors(attr.g)
            for sub in attr.graphs:
                yield from _graph_tensors(sub)


def _on_disk(t: TensorProto) -> bool:
    """The tensor's bytes are in an external file, not in memory."""
    return edh.uses_external_data(t) and not t.HasField("raw_data")


def tensor_nbytes(t: TensorProto) -> int | None:
    """Bytes of the tensor's data from its dims and element type (None if unknown or STRING);
    packed types take ceil(elements x bits / 8) bytes, as onnx's ``pack_*`` helpers write them."""
    n = math.prod(t.dims)
    if t.data_type in _PACKED:
        return -(-n * _PACKED[t.data_type] // 8)
    if t.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return None
    try:
        return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return None


def model_nbytes(model: onnx.ModelProto) -> int:
    """Approximate serialized size: tensor payloads in memory or on disk, plus the graph."""
    total = 0
    for t in tensors(model):
        if t.HasField("raw_data"):
            total += len(t.raw_data)
        elif edh.uses_external_data(t):
            info = edh.ExternalDataInfo(t)
            total += info.length if info.length is not None else (tensor_nbytes(t) or 0)
        else:
            total += t.ByteSize()
    return total + 64 * len(model.graph.node)


def save_model_atomic(model: onnx.ModelProto, path: str | Path, *, external_data: bool | None = None,
                      base_dir: str | Path | None = None) -> Path:
    """Save ``model`` to ``path`` by writing new files and renaming them into place.

    Args:
        model: the graph. Tensors still on disk (lazy load) are read from
            ``base_dir`` one at a time. With external data, the model's large
            tensors afterwards refer to the saved ``<name>.data`` (their bytes
            are dropped from memory): do not save the same object elsewhere.
            Its machine metadata is stripped in place (:func:`strip_machine_metadata`).
        path: the ``.onnx`` file; its data file is ``<path>.data``.
        external_data: force (True) or refuse (False) external data; None picks
            it when :func:`model_nbytes` reaches :func:`external_data_threshold`.
        base_dir: folder that on-disk tensors' relative locations refer to.

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: the model has tensors on disk but no ``base_dir`` is given.
        PipelineError: a bad ``PIPELINE_EXTERNAL_DATA_THRESHOLD``.
        OSError: writing or renaming failed (the previous file is left as it was).
    """
    path = Path(path)
    lazy = any(_on_disk(t) for t in tensors(model))
    if lazy and base_dir is None:
        raise ValueError(f"saving {path}: the model has tensors on disk; pass base_dir (the folder they refer to)")
    use_external = external_data if external_data is not None else model_nbytes(model) >= external_data_threshold()
    strip_machine_metadata(model)
    with replacing(path, strip=False) as tmp:  # stripped here, in memory
        if use_external:
            _write_external(model, tmp, base_dir)
        else:
            if lazy:
                edh.load_external_data_for_model(model, str(base_dir))
            onnx.save_model(model, str(tmp))
    return path


def _write_external(model: onnx.ModelProto, tmp: Path, base_dir: str | Path | None) -> None:
    """Stream every large tensor into ``tmp``'s data file, then write the graph."""
    location = data_file_name(tmp)
    for t in tensors(model):
        if _on_disk(t):
            edh.load_external_data_for_tensor(t, str(base_dir))  # this tensor only
        if t.HasField("raw_data") and len(t.raw_data) >= MIN_EXTERNAL_TENSOR:
            edh.set_external_data(t, location)
            edh.save_external_data(t, str(tmp.parent))  # appends, records offset and length
            t.ClearField("raw_data")
    onnx.save_model(model, str(tmp))


@contextlib.contextmanager
def replacing(path: str | Path, *, strip: bool = True) -> Iterator[Path]:
    """``with replacing(p) as tmp: write(tmp)``: the files then replace ``p`` and its data.

    ``tmp`` has ``p``'s name, in a new folder beside ``p``; every file written
    there (the graph and any external data files it names) is renamed into
    ``p``'s folder, data files first and the graph last. A stale ``<p>.data``
    that the new graph no longer uses is removed. If the block raises, nothing
    at ``p`` changes.

    Args:
        strip: first strip the written graph's machine metadata
            (:func:`strip_file`); False when the writer already did.

    Raises:
        EnvironmentFault: the block wrote no file named ``tmp``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=path.parent, prefix=scratch_prefix(path)))
    try:
        tmp = scratch / path.name
        fault_point(f"write:{path.name}", path)
        yield tmp
        if not tmp.is_file():
            raise EnvironmentFault(f"{path}: the writer produced no file at {tmp}")
        if strip:
            strip_file(tmp)
        files = sorted(p for p in scratch.rglob("*") if p.is_file() and p != tmp)
        for f in [*files, tmp]:
            _fsync(f)
        for f in files:
            dest = path.parent / f.relative_to(scratch)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, dest)
        os.replace(tmp, path)
        stale = path.parent / data_file_name(path)
        if stale.exists() and not any(f.name == stale.name and f.parent == scratch for f in files):
            stale.unlink()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def strip_machine_metadata(model: onnx.ModelProto) -> int:
    """Remove, in place, what records the build machine rather than the graph.

    That is every ``metadata_props`` entry keyed in :data:`MACHINE_METADATA_KEYS`
    (on the model, graphs, subgraphs, functions, nodes, value infos and
    initializers) and every node ``doc_string`` (torch's TorchScript exporter
    wrote the Python stack trace there). Node names, ``name_scopes`` and the
    producer name/version are kept: they depend on the model and the tools only.

    Returns:
        How many entries were removed or cleared.
    """
    removed = _strip_props(model.metadata_props) + _strip_graph(model.graph)
    for fn in model.functions:
        removed += _strip_props(fn.metadata_props) + sum(_strip_node(n) for n in fn.node)
    return removed


def _strip_props(props) -> int:
    """Drop the machine-specific entries of a repeated ``StringStringEntryProto`` field."""
    drop = [i for i, p in enumerate(props) if p.key in MACHINE_METADATA_KEYS]
    for i in reversed(drop):
        del props[i]
    return len(drop)


def _strip_graph(graph: onnx.GraphProto) -> int:
    removed = _strip_props(graph.metadata_props) + sum(_strip_node(n) for n in graph.node)
    for value in [*graph.input, *graph.output, *graph.value_info]:
        removed += _strip_props(value.metadata_props)
    return removed + sum(_strip_props(t.metadata_props) for t in graph.initializer)


def _strip_node(node: onnx.NodeProto) -> int:
    removed = _strip_props(node.metadata_props)
    if node.doc_string:
        node.doc_string = ""
        removed += 1
    for attr in node.attribute:
        subgraphs = [attr.g] if attr.HasField("g") else []
        removed += sum(_strip_graph(g) for g in [*subgraphs, *attr.graphs])
    return removed


def strip_file(path: str | Path) -> int:
    """:func:`strip_machine_metadata` of the ONNX file at ``path``, rewritten in place only
    when something was removed. External data files are neither read nor changed.

    Returns:
        How many entries were removed.

    Raises:
        EnvironmentFault: the file does not parse as ONNX (names it).
    """
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError and others
        raise EnvironmentFault(f"{path}: the writer produced a file that does not parse as ONNX "
                               f"({type(e).__name__}: {e})") from e
    removed = strip_machine_metadata(model)
    if removed:
        onnx.save_model(model, str(path))  # tensors on disk stay references: only the graph is written
    return removed


def save_graph(model: onnx.ModelProto, path: str | Path) -> None:
    """Write ``model``'s graph proto alone to the new file ``path``: tensors kept on disk
    (external data) stay references to their files, which the caller places beside it.

    Raises:
        FileExistsError: ``path`` exists (a published copy is never rewritten in place).
    """
    with open(path, "xb") as fh:
        fault_point(f"write:{Path(path).name}", path)
        fh.write(model.SerializeToString())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def external_files(model: onnx.ModelProto) -> set[str]:
    """Relative locations of the external data files the graph refers to (normalized: ``./a`` is ``a``)."""
    return {os.path.normpath(edh.ExternalDataInfo(t).location) for t in tensors(model) if edh.uses_external_data(t)}


def files_on_disk_bytes(path: str | Path) -> int:
    """Bytes of the ``.onnx`` file plus the external data files it names."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    return path.stat().st_size + sum((path.parent / loc).stat().st_size for loc in external_files(model))


def check_loadable(path: str | Path) -> str | None:
    """None when the ONNX file at ``path`` can be loaded, else the reason.

    Checks that the graph parses and that each external-data location is a
    relative path inside the file's folder naming an existing file that holds
    ``offset + length`` bytes for every tensor, and that a declared ``length`` is
    the size its dtype and shape need. Not ``onnx.checker``: it
    rejects graphs ONNX Runtime and TensorRT load (e.g. ORT's FP16 converter
    leaves nodes out of topological order).
    """
    path = Path(path)
    if not path.is_file():
        return f"{path}: no such file"
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError and others
        return f"{path}: does not parse as ONNX ({type(e).__name__}: {e})"
    return external_data_problem(model, path)


def relative_location(location: str) -> str | None:
    """``location`` (an external data path) normalized, or None when it is empty, absolute or
    leaves the graph's folder. Checked on the path as written, not resolved: a symlink inside
    the folder (a hub cache's snapshot) may point anywhere."""
    where = os.path.normpath(location) if location else ""
    if not where or os.path.isabs(where) or where == ".." or where.startswith(".." + os.sep):
        return None
    return where


def external_data_problem(model: onnx.ModelProto, path: str | Path) -> str | None:
    """None when every external-data tensor of ``model`` (loaded from ``path`` without its
    data) is readable, else what is wrong, naming the tensor and the file: a location that
    is absolute or leaves the graph's folder, a missing file, a declared ``length`` other
    than its dtype and shape need, or a file shorter than ``offset + length``."""
    path = Path(path)
    sizes: dict[Path, int] = {}
    for t in tensors(model):
        if not edh.uses_external_data(t):
            continue
        try:
            info = edh.ExternalDataInfo(t)
        except ValueError as e:
            return f"{path}: tensor {t.name!r}: {e}"
        where = relative_location(info.location)
        if where is None:
            return (f"{path}: tensor {t.name!r} has external data location {info.location!r} outside "
                    f"{path.parent} (a relative path inside the graph's folder is required)")
        file = path.parent / where  # a symlink inside the folder (a hub cache's snapshot) is fine
        if file not in sizes:
            if not file.is_file():
                return f"{path}: tensor {t.name!r} keeps its weights in {info.location!r}, which is missing ({file})"
            sizes[file] = file.stat().st_size
        need = tensor_nbytes(t)
        if info.length is not None and need is not None and info.length != need:
            return (f"{path}: tensor {t.name!r} declares external data length {info.length} bytes but its "
                    f"dtype and shape {list(t.dims)} need {need}")
        end = (info.offset or 0) + (info.length if info.length is not None else need or 0)
        if sizes[file] < end:
            return (f"{path}: tensor {t.name!r} needs bytes up to {end} of {file} (offset {info.offset or 0}), "
                    f"which has only {sizes[file]} bytes; the file is truncated or from another export: "
                    "copy it again with the graph")
    return None


def require_loadable(path: str | Path, stage: str) -> None:
    """Fail the stage when the file it just wrote cannot be loaded.

    Raises:
        EnvironmentFault: names the file and why (a storage fault: disk full, truncation).
    """
    reason = check_loadable(path)
    if reason:
        raise EnvironmentFault(f"{stage}: the ONNX file it wrote cannot be loaded: {reason}")


#: ONNX element types -> numpy dtype names (``object`` for strings).
ONNX_DTYPES: dict[int, str] = {
    TensorProto.BOOL: "bool", TensorProto.UINT8: "uint8", TensorProto.UINT16: "uint16",
    TensorProto.UINT32: "uint32", TensorProto.UINT64: "uint64", TensorProto.INT8: "int8",
    TensorProto.INT16: "int16", TensorProto.INT32: "int32", TensorProto.INT64: "int64",
    TensorProto.FLOAT16: "float16", TensorProto.FLOAT: "float32", TensorProto.DOUBLE: "float64",
    TensorProto.BFLOAT16: "bfloat16", TensorProto.STRING: "object",
}
#: The dim of a graph input/output that has neither a fixed size nor a name.
UNKNOWN_DIM = "?"


def name_nodes(model: onnx.ModelProto) -> int:
    """Give every unnamed or duplicate-named node of the main graph a unique name
    (``<op_type>_<index>``), in place: quantization, exclusions and sensitivity groups
    address nodes by name, and ONNX allows graphs (from other exporters) without them.
    Returns how many nodes were renamed."""
    taken = {n.name for n in model.graph.node if n.name}
    seen: set[str] = set()
    renamed = 0
    for i, node in enumerate(model.graph.node):
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        name, k = f"{node.op_type}_{i}", 0
        while name in taken or name in seen:
            k += 1
            name = f"{node.op_type}_{i}_{k}"
        node.name = name
        seen.add(name)
        renamed += 1
    return renamed


def graph_specs(model: onnx.ModelProto) -> tuple[list["TensorSpec"], list["TensorSpec"]]:
    """Graph inputs (initializers excluded) and outputs as TensorSpecs: the one graph I/O reader.

    Dims: ``dim_value`` -> int, ``dim_param`` -> its name, neither -> ``"?"``
    (:data:`UNKNOWN_DIM`: a string, so every check that treats names as dynamic
    treats it as dynamic too; never ``0``, which would read as a fixed empty axis).
    Dtypes: numpy names; an element type outside :data:`ONNX_DTYPES` keeps its
    ONNX name (e.g. ``"FLOAT8E4M3FN"``), which the Triton config refuses by name.
    """
    from pipeline.artifacts import TensorSpec

    initializers = {t.name for t in model.graph.initializer}

    def spec(value: onnx.ValueInfoProto) -> TensorSpec:
        tensor = value.type.tensor_type
        dtype = ONNX_DTYPES.get(tensor.elem_type, TensorProto.DataType.Name(tensor.elem_type))
        shape: list[int | str] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or UNKNOWN_DIM) for d in tensor.shape.dim
        ]
        return TensorSpec(value.name, dtype, shape)

    inputs = [spec(v) for v in model.graph.input if v.name not in initializers]
    return inputs, [spec(v) for v in model.graph.output]


def initializer_array(t: TensorProto, base_dir: str | Path = "") -> "np.ndarray":
    """An initializer's values as a numpy array (its own dtype), read from ``base_dir`` (the model
    file's folder) through a copy when its data is external, so the model's own TensorProto never
    holds the bytes."""
    from onnx import numpy_helper

    if not edh.uses_external_data(t) or t.HasField("raw_data"):
        return numpy_helper.to_array(t)
    probe = TensorProto()
    probe.CopyFrom(t)
    return numpy_helper.to_array(probe, str(base_dir))


def graph_index(g: onnx.GraphProto) -> tuple[dict[str, onnx.TensorProto], dict[str, onnx.NodeProto],
                                             dict[str, list[onnx.NodeProto]]]:
    """The lookups a graph rewrite needs, built once: initializer name -> initializer, tensor name -> the
    node that produces it, tensor name -> the nodes that read it (graph order; a missing name reads as
    an empty list). Reads no weight data."""
    from collections import defaultdict

    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)
    return inits, producer, consumers
