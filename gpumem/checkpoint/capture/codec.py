"""The state tree codec: Python values <-> (JSON tree, tensor table).

Non-tensor values become JSON with a few tags for what JSON lacks (tuples, non-string keys,
non-finite floats, bytes, NumPy arrays); every tensor becomes a reference ``{"__tensor__": name}``
into the tensor table, whose bytes go to the data files. Decoding builds only plain containers,
numbers, strings, bytes, tensors and NumPy arrays of allowed dtypes: nothing is imported or called.

Encoding refuses, naming the key, whatever could not be read back: tensors without local bytes on
the CPU or a CUDA device, integers beyond ``MAX_INT_BITS`` bits, nesting deeper than
``MAX_DEPTH``. Decoding turns whatever a hostile tree makes fail into CheckpointCorruptError.
Capturing training objects is ``training_state``'s, loading them ``restore.load``'s.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointStateError
from . import dtensor

_TAGS = frozenset(
    {"__tensor__", "__dtensor__", "__tuple__", "__dict__", "__float__", "__bytes__", "__ndarray__"}
)
_NP_DTYPES = frozenset(
    f"{order}{kind}{size}" for order in "<>|" for kind in "biuf" for size in (1, 2, 4, 8)
) | frozenset({"<c8", "<c16", ">c8", ">c16"})
_UNSAFE_NAME = re.compile(r"[/\\\0]")  # path separators and NUL never reach a tensor name
MAX_DEPTH = 100  # containers in containers: far beyond any state dict, well within the parsers'
MAX_INT_BITS = 1024  # a 309-digit integer: seeds and counters fit, JSON parsers read it back
_INT_LIMIT = 1 << MAX_INT_BITS
_DEVICES = ("cpu", "cuda")  # where tensors have bytes the snapshot can copy

# dtype names the format accepts; anything else in a manifest is rejected, never interpreted
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}


@dataclass
class TensorTable:
    """The tensors of one capture, in save order, with identical views stored once.

    Attributes:
        names: unique tensor names (no path separators), in save order.
        tensors: detached tensors without a lazy conjugate/negative bit.
        deferred: whether each tensor may be copied after save() returns.
        has_cuda: whether any tensor is on a CUDA device.
        replicated_count: how many leading tensors came from the replicated sections (model,
            optimizer, scheduler, scaler: ``replicated.REPLICATED_KEYS``), which capture() encodes
            first; a tensor the rank's own state shares with them is one of those.
        blocks: per tensor, its DTensor block (``dtensor.LocalBlock``: the local shard's box of
            the global tensor) or None for a plain tensor. A DTensor replica that another rank
            writes is named but not added (see ``sharding``).
        param_fqns: optimizer parameter index -> model parameter name, so that DTensor optimizer
            state is named after its parameter (``optimizer.state.<fqn>.<key>``), the same on
            every rank that holds a shard of it even when ranks hold different parameters
            (pipeline stages).
    """

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    deferred: list[bool] = field(default_factory=list)
    has_cuda: bool = False
    replicated_count: int = 0
    blocks: list[dtensor.LocalBlock | None] = field(default_factory=list)
    param_fqns: dict[int, str] = field(default_factory=dict)
    _seen: dict[tuple, str] = field(default_factory=dict)
    _taken: set[str] = field(default_factory=set)

    @property
    def sharded(self) -> bool:
        return any(x is not None for x in self.blocks)

    def add(self, t: torch.Tensor, path: str, deferred: bool) -> str:
        """Add ``t`` (captured under ``path``) unless an identical view is in already; its name."""
        dtype = t.dtype
        if dtype not in DTYPE_NAMES:
            raise CheckpointStateError(
                f"{path}: dtype {dtype} cannot be stored; convert the tensor first"
            )
        if t.layout != torch.strided:
            raise CheckpointStateError(
                f"{path}: {t.layout} tensors cannot be stored; call .to_dense() first"
            )
        if t.device.type not in _DEVICES:
            raise CheckpointStateError(
                f"{path}: a tensor on {t.device} has no bytes gpumem can copy; "
                "move it to the CPU or a CUDA device first"
            )
        block = None
        if type(t) is not torch.Tensor and dtensor.is_dtensor(t):
            # the local shard, detached directly: a DTensor's own detach() goes through its
            # dispatch (~0.1 ms a tensor, hundreds of them per save)
            block = dtensor.describe(t, path)
            t = dtensor.local_tensor(t).detach()
            path = self._global_name(path)
        else:
            t = t.detach()
        if type(t) is not torch.Tensor:  # a subclass: refuse what has no local bytes of its own
            _check_subclass(t, path)
        conj, neg = t.is_conj(), t.is_neg()
        # Same device, first byte, dtype, shape and strides (and lazy bits): the same values.
        # data_ptr() includes the storage offset, so views at different offsets stay apart.
        key = (
            (t.device, dtype, t.data_ptr(), t.shape, t.stride(), conj, neg, block is None)
            if t.numel()
            else None
        )
        if key is not None and key in self._seen:  # tied weights: one copy on disk, two references
            return self._seen[key]
        if conj or neg:  # the format stores plain values; resolve the lazy bit into a copy now
            t = t.resolve_conj().resolve_neg()
        if "/" in path or "\\" in path or "\0" in path:  # cheaper than the regex on every name
            path = _UNSAFE_NAME.sub("_", path)
        name = path[:900] or "tensor"
        if name in self._taken:
            # counted over every name, written or not, so ranks with the same state agree
            base, n = name, len(self._taken)
            while name in self._taken:
                name, n = f"{base}~{n}", n + 1
        if key is not None:
            self._seen[key] = name
        self._taken.add(name)
        if block is not None and not block.writer:
            return name  # a replica: the first replica's rank writes these bytes
        self.names.append(name)
        self.tensors.append(t)
        self.deferred.append(deferred)
        self.blocks.append(block)
        self.has_cuda = self.has_cuda or t.is_cuda
        return name

    def _global_name(self, path: str) -> str:
        """A DTensor's name: its path, with an optimizer state's parameter index replaced by the
        parameter's name where capture() knows it."""
        if self.param_fqns and path.startswith("optimizer.state."):
            pid, _, rest = path[len("optimizer.state.") :].partition(".")
            fqn = self.param_fqns.get(int(pid)) if pid.isdigit() else None
            if fqn is not None:
                return f"optimizer.state.{fqn}.{rest}"
        return path

    def subset(self, indices: list[int]) -> TensorTable:
        """The tensors at ``indices`` (in that order) as a table of their own, for writing only:
        it cannot take more tensors (views already seen are not tracked)."""
        tensors = [self.tensors[i] for i in indices]
        return TensorTable(
            names=[self.names[i] for i in indices],
            tensors=tensors,
            deferred=[self.deferred[i] for i in indices],
            has_cuda=any(t.is_cuda for t in tensors),
            blocks=[self.blocks[i] for i in indices],
        )


def _check_subclass(t: torch.Tensor, path: str) -> None:
    """Wrapper subclasses other than DTensor hold no bytes of their own: say so, and what to do,
    instead of failing deep inside the copy."""
    if hasattr(t, "__tensor_flatten__"):
        raise CheckpointStateError(
            f"{path}: a {type(t).__name__} tensor subclass wraps other tensors "
            "and cannot be stored as raw bytes; convert it to a plain tensor first"
        )


# ---------------------------------------------------------------------------------------------
# encoding


_PLAIN = frozenset({str, bool, type(None)})  # exact types that are JSON as they are


def _plain(v: Any) -> bool:
    """JSON as it is, without a call: plain scalars and ints within the bound (an optimizer's
    param_groups hold long lists of ints); exact types only, so subclasses get converted."""
    t = type(v)
    return t in _PLAIN or (t is int and -_INT_LIMIT < v < _INT_LIMIT)


def encode(
    value: Any, path: str, table: TensorTable, deferred: bool = False, depth: int = 0
) -> Any:
    """JSON-able form of ``value``; tensors go to ``table``. Raises CheckpointStateError on what
    the format cannot hold or read back (naming the key)."""
    if _plain(value):
        return value
    if isinstance(value, torch.Tensor):
        tag = "__dtensor__" if dtensor.is_dtensor(value) else "__tensor__"
        return {tag: table.add(value, path, deferred)}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not -_INT_LIMIT < value < _INT_LIMIT:
            raise CheckpointStateError(
                f"{path}: an integer of {value.bit_length()} bits cannot be stored (the limit is "
                f"{MAX_INT_BITS} bits); store it as a string or bytes"
            )
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"__float__": repr(float(value))}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, (tuple, list, dict)) and depth >= MAX_DEPTH:
        raise CheckpointStateError(
            f"{path}: nested more than {MAX_DEPTH} containers deep; flatten it before saving"
        )
    if isinstance(value, tuple):
        return {"__tuple__": _encode_items(value, path, table, deferred, depth + 1)}
    if isinstance(value, list):
        return _encode_items(value, path, table, deferred, depth + 1)
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (
            len(value) == 1 and next(iter(value)) in _TAGS
        ):
            return {
                k: v if _plain(v) else encode(v, f"{path}.{k}", table, deferred, depth + 1)
                for k, v in value.items()
            }
        return {
            "__dict__": [
                [_encode_key(k, path), encode(v, f"{path}.{k}", table, deferred, depth + 1)]
                for k, v in value.items()
            ]
        }
    np = numpy_module()
    if np is not None and isinstance(value, np.ndarray):
        dtype = value.dtype.str
        if dtype not in _NP_DTYPES:
            raise CheckpointStateError(f"{path}: NumPy dtype {value.dtype} cannot be stored")
        raw = torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8).copy())
        return {
            "__ndarray__": {
                "dtype": dtype,
                "shape": list(value.shape),
                "tensor": table.add(raw, path, False),
            }
        }
    if np is not None and isinstance(value, np.generic):
        return encode(value.item(), path, table, deferred, depth)
    raise CheckpointStateError(
        f"{path}: a {type(value).__name__} cannot be stored in a "
        "checkpoint (JSON values, tuples, tensors and NumPy arrays can); "
        "convert it, or save it with a stateful object's state_dict()"
    )


def _encode_items(
    values: list | tuple, path: str, table: TensorTable, deferred: bool, depth: int
) -> list:
    return [
        v if _plain(v) else encode(v, f"{path}.{i}", table, deferred, depth)
        for i, v in enumerate(values)
    ]


def _encode_key(key: Any, path: str) -> Any:
    if _plain(key):
        return key
    if key is None or isinstance(key, (bool, int, float, str)):
        return encode(key, path, _NO_TENSORS)
    if isinstance(key, tuple):
        return {"__tuple__": [_encode_key(k, path) for k in key]}
    raise CheckpointStateError(f"{path}: dict key of type {type(key).__name__} cannot be stored")


_NO_TENSORS = TensorTable()  # for dict keys, which are scalars or tuples of them: never written


def tensor_refs(node: Any) -> set[str]:
    """The names of the plain tensors a JSON state tree refers to (``{"__tensor__": name}``,
    NumPy arrays' ``{"__ndarray__": {"tensor": name, ...}}``); an explicit stack: a hostile
    tree's depth costs no recursion."""
    out: set[str] = set()
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if len(x) == 1 and isinstance(x.get("__tensor__"), str):
                out.add(x["__tensor__"])
            elif len(x) == 1 and isinstance(x.get("__ndarray__"), dict):
                ref = x["__ndarray__"].get("tensor")
                if isinstance(ref, str):
                    out.add(ref)
            else:
                stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return out


def decode(
    node: Any,
    tensors: Mapping[str, Any],
    path: str = "state",
    dtensors: Mapping[str, Any] | None = None,
) -> Any:
    """Rebuild a value from its JSON form; ``tensors`` maps names to loaded tensors, ``dtensors``
    (default: ``tensors``) the names of global (DTensor) tensors to what stands for them.

    Raises:
        CheckpointCorruptError: the tree does not decode, whatever the reason.
    """
    refs = (tensors, tensors if dtensors is None else dtensors)
    try:
        return _decode(node, refs, path)
    except RecursionError:
        raise CheckpointCorruptError(f"{path}: state is nested too deeply") from None
    except CheckpointError:
        raise
    except Exception as exc:  # a hostile value nobody anticipated is still only damage
        raise CheckpointCorruptError(
            f"{path}: state does not decode ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc


_Refs = tuple[Mapping[str, Any], Mapping[str, Any]]


def _decode(node: Any, tensors: _Refs, path: str) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors, path) for v in node]
    if not isinstance(node, dict):
        raise CheckpointCorruptError(f"{path}: unexpected JSON value")
    if len(node) == 1 and next(iter(node)) in _TAGS:
        tag, arg = next(iter(node.items()))
        return _decode_tagged(tag, arg, tensors, path)
    return {k: _decode(v, tensors, f"{path}.{k}") for k, v in node.items()}


def _decode_tagged(tag: str, arg: Any, tensors: _Refs, path: str) -> Any:
    bad = CheckpointCorruptError(f"{path}: malformed {tag} value")
    if tag in ("__tensor__", "__dtensor__"):
        table = tensors[tag == "__dtensor__"]
        if not isinstance(arg, str) or arg not in table:
            where = "no shard holds" if tag == "__dtensor__" else "the table lacks"
            raise CheckpointCorruptError(
                f"{path}: refers to tensor {str(arg)[:80]!r}, which {where}"
            )
        return table[arg]
    if tag == "__tuple__":
        if not isinstance(arg, list):
            raise bad
        return tuple(_decode(v, tensors, path) for v in arg)
    if tag == "__dict__":
        if not isinstance(arg, list) or not all(isinstance(p, list) and len(p) == 2 for p in arg):
            raise bad
        out = {}
        for k, v in arg:
            key = _decode(k, tensors, path)
            if not _hashable_key(key):
                raise bad
            out[key] = _decode(v, tensors, f"{path}.{key}")
        return out
    if tag == "__float__":
        if arg not in ("inf", "-inf", "nan"):
            raise bad
        return float(arg)
    if tag == "__bytes__":
        try:
            return base64.b64decode(arg, validate=True) if isinstance(arg, str) else _raise(bad)
        except ValueError:
            raise bad from None
    if tag == "__ndarray__":
        np = numpy_module()
        if not isinstance(arg, dict) or set(arg) != {"dtype", "shape", "tensor"} or np is None:
            raise bad
        if (
            not isinstance(arg["dtype"], str)
            or arg["dtype"] not in _NP_DTYPES
            or not isinstance(arg["shape"], list)
        ):
            raise bad
        raw = _decode_tagged("__tensor__", arg["tensor"], tensors, path)
        if not isinstance(raw, torch.Tensor):  # structural check only (verify without loading)
            return None
        dtype = np.dtype(arg["dtype"])
        try:
            return raw.numpy().view(dtype).reshape(arg["shape"]).copy()
        except (ValueError, TypeError):
            raise bad from None
    raise bad


def _raise(exc: Exception) -> Any:
    raise exc


def _hashable_key(key: Any) -> bool:
    if key is None or isinstance(key, (bool, int, float, str)):
        return True
    return isinstance(key, tuple) and all(_hashable_key(k) for k in key)


def numpy_module():
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover - numpy ships with torch wheels
        return None
