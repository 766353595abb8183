"""Training state <-> (JSON tree, tensor table): capture for save(), checked rebuild for restore().

Non-tensor values become JSON with a few tags for what JSON lacks (tuples, non-string keys,
non-finite floats, bytes, NumPy arrays); every tensor becomes a reference ``{"__tensor__": name}``
into the tensor table, whose bytes go to the data files. Decoding builds only plain containers,
numbers, strings, bytes, tensors and NumPy arrays of allowed dtypes: nothing is imported or called.

Parameters and optimizer state are marked *deferred*: only the optimizer step mutates them, so
overlap mode may copy them after save() returns. Everything else (buffers such as BatchNorm running
statistics, RNG states, user extras) is copied before save() returns.
"""

from __future__ import annotations

import base64
import math
import random
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import sharding
from .errors import CheckpointCorruptError, CheckpointStateError
from .format import DTYPE_NAMES

_TAGS = frozenset(
    {"__tensor__", "__dtensor__", "__tuple__", "__dict__", "__float__", "__bytes__", "__ndarray__"}
)
_COMPILE_PREFIX = "_orig_mod."
_NP_DTYPES = frozenset(
    f"{order}{kind}{size}" for order in "<>|" for kind in "biuf" for size in (1, 2, 4, 8)
) | frozenset({"<c8", "<c16", ">c8", ">c16"})
_UNSAFE_NAME = re.compile(r"[/\\\0]")  # path separators and NUL never reach a tensor name


@dataclass
class TensorTable:
    """The tensors of one capture, in save order, with identical views stored once.

    Attributes:
        names: unique tensor names (no path separators), in save order.
        tensors: detached tensors without a lazy conjugate/negative bit.
        deferred: whether each tensor may be copied after save() returns.
        has_cuda: whether any tensor is on a CUDA device.
        replicated_count: how many leading tensors came from the replicated sections (model,
            optimizer, scheduler, scaler: ``format.REPLICATED_KEYS``), which capture() encodes
            first; a tensor the rank's own state shares with them is one of those.
        layouts: per tensor, its DTensor layout (``sharding.Layout``: the local shard's box of
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
    layouts: list[sharding.Layout | None] = field(default_factory=list)
    param_fqns: dict[int, str] = field(default_factory=dict)
    _seen: dict[tuple, str] = field(default_factory=dict)
    _taken: set[str] = field(default_factory=set)

    @property
    def sharded(self) -> bool:
        return any(x is not None for x in self.layouts)

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
        layout = None
        if type(t) is not torch.Tensor and sharding.is_dtensor(t):
            # the local shard, detached directly: a DTensor's own detach() goes through its
            # dispatch (~0.1 ms a tensor, hundreds of them per save)
            layout = sharding.describe(t, path)
            t = sharding.local_tensor(t).detach()
            path = self._global_name(path)
        else:
            t = t.detach()
        if type(t) is not torch.Tensor:  # a subclass: refuse what has no local bytes of its own
            _check_subclass(t, path)
        conj, neg = t.is_conj(), t.is_neg()
        # Same device, first byte, dtype, shape and strides (and lazy bits): the same values.
        # data_ptr() includes the storage offset, so views at different offsets stay apart.
        key = (
            (t.device, dtype, t.data_ptr(), t.shape, t.stride(), conj, neg, layout is None)
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
        if layout is not None and not layout.writer:
            return name  # a replica: the first replica's rank writes these bytes
        self.names.append(name)
        self.tensors.append(t)
        self.deferred.append(deferred)
        self.layouts.append(layout)
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
            layouts=[self.layouts[i] for i in indices],
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


_PLAIN = frozenset({str, int, bool, type(None)})  # exact types that are JSON as they are


def encode(value: Any, path: str, table: TensorTable, deferred: bool = False) -> Any:
    """JSON-able form of ``value``; tensors go to ``table``. Raises CheckpointStateError on types
    the format cannot hold (naming the key)."""
    # Containers pass plain scalars through without a call (an optimizer's param_groups hold
    # long lists of ints); exact types only, so that subclasses get the conversions below.
    if type(value) in _PLAIN:
        return value
    if isinstance(value, torch.Tensor):
        tag = "__dtensor__" if sharding.is_dtensor(value) else "__tensor__"
        return {tag: table.add(value, path, deferred)}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"__float__": repr(float(value))}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, tuple):
        return {"__tuple__": _encode_items(value, path, table, deferred)}
    if isinstance(value, list):
        return _encode_items(value, path, table, deferred)
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (
            len(value) == 1 and next(iter(value)) in _TAGS
        ):
            return {
                k: v if type(v) in _PLAIN else encode(v, f"{path}.{k}", table, deferred)
                for k, v in value.items()
            }
        return {
            "__dict__": [
                [_encode_key(k, path), encode(v, f"{path}.{k}", table, deferred)]
                for k, v in value.items()
            ]
        }
    np = _numpy()
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
        return encode(value.item(), path, table, deferred)
    raise CheckpointStateError(
        f"{path}: a {type(value).__name__} cannot be stored in a "
        "checkpoint (JSON values, tuples, tensors and NumPy arrays can); "
        "convert it, or save it with a stateful object's state_dict()"
    )


def _encode_items(values: list | tuple, path: str, table: TensorTable, deferred: bool) -> list:
    return [
        v if type(v) in _PLAIN else encode(v, f"{path}.{i}", table, deferred)
        for i, v in enumerate(values)
    ]


def _encode_key(key: Any, path: str) -> Any:
    if type(key) in _PLAIN:
        return key
    if key is None or isinstance(key, (bool, int, float, str)):
        return encode(key, path, _NO_TENSORS)
    if isinstance(key, tuple):
        return {"__tuple__": [_encode_key(k, path) for k in key]}
    raise CheckpointStateError(f"{path}: dict key of type {type(key).__name__} cannot be stored")


_NO_TENSORS = TensorTable()  # for dict keys, which are scalars or tuples of them: never written


def decode(
    node: Any,
    tensors: Mapping[str, Any],
    path: str = "state",
    dtensors: Mapping[str, Any] | None = None,
) -> Any:
    """Rebuild a value from its JSON form; ``tensors`` maps names to loaded tensors, ``dtensors``
    (default: ``tensors``) the names of global (DTensor) tensors to what stands for them."""
    refs = (tensors, tensors if dtensors is None else dtensors)
    try:
        return _decode(node, refs, path)
    except RecursionError:
        raise CheckpointCorruptError(f"{path}: state is nested too deeply") from None


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
        np = _numpy()
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


def _numpy():
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover - numpy ships with torch wheels
        return None


# ---------------------------------------------------------------------------------------------
# capture


def unwrap_model(model: Any) -> Any:
    """The module inside DistributedDataParallel / DataParallel wrappers: they add a ``module.``
    prefix to every key but hold the same replicated state, so wrapped and plain models save and
    restore the same checkpoint (as torch.compile'd and plain ones do through canonical_key)."""
    wrappers = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(
            getattr(model, "_orig_mod", None), torch.nn.Module
        ):
            model = model._orig_mod  # torch.compile(DDP(model)): look through both
        else:
            return model


def canonical_key(key: str) -> str:
    """Model key without torch.compile's ``_orig_mod.`` components, so wrapped and plain models
    match."""
    return key.replace(_COMPILE_PREFIX, "") if _COMPILE_PREFIX in key else key


def param_names(model: Any, optimizer: Any) -> dict[int, str]:
    """Optimizer parameter index (as ``optimizer.state_dict()`` numbers them: first appearance in
    ``param_groups``) -> the model's name for that parameter (the first, for tied ones)."""
    names: dict[int, str] = {}
    for name, p in unwrap_model(model).named_parameters():
        names.setdefault(id(p), canonical_key(name))
    out, seen = {}, set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) in names:
                out[len(seen) - 1] = names[id(p)]
    return out


def capture(
    step: int,
    *,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    extra: dict[str, Any] | None = None,
    stateful: dict[str, Any] | None = None,
    rng: bool = True,
) -> tuple[dict[str, Any], TensorTable]:
    """The state to save as a JSON tree plus its tensors (not yet copied)."""
    table = TensorTable()
    tree: dict[str, Any] = {"step": step}
    if model is not None:
        sd = unwrap_model(model).state_dict(keep_vars=True)
        # parameters are deferred (only the optimizer step mutates them); buffers are copied at once
        tree["model"] = {
            canonical_key(k): encode(
                v, f"model.{canonical_key(k)}", table, isinstance(v, torch.nn.Parameter)
            )
            for k, v in sd.items()
        }
    if optimizer is not None:
        if model is not None:
            table.param_fqns = param_names(model, optimizer)
        tree["optimizer"] = encode(optimizer.state_dict(), "optimizer", table, deferred=True)
    for key, obj in (("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            tree[key] = encode(_state_dict_of(obj, key), key, table)
    table.replicated_count = len(
        table.names
    )  # REPLICATED_KEYS come first; the rank's own state follows
    if extra is not None:
        if not isinstance(extra, dict):
            raise CheckpointStateError(f"extra must be a dict, got {type(extra).__name__}")
        tree["extra"] = encode(extra, "extra", table)
    if stateful:
        tree["stateful"] = {
            str(name): encode(_state_dict_of(obj, f"stateful[{name!r}]"), f"stateful.{name}", table)
            for name, obj in stateful.items()
        }
    if rng:
        tree["rng"] = encode(rng_state(), "rng", table)
    return tree, table


def _state_dict_of(obj: Any, what: str) -> Any:
    if not callable(getattr(obj, "state_dict", None)):
        raise CheckpointStateError(
            f"{what} ({type(obj).__name__}) has no state_dict(); "
            "pass objects with state_dict/load_state_dict"
        )
    return obj.state_dict()


def rng_state() -> dict[str, Any]:
    """RNG states of Python, NumPy (global), torch CPU and every CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    np = _numpy()
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    saved_cuda = state.get("cuda") or []
    if saved_cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if n != len(saved_cuda):
            warnings.warn(
                f"checkpoint has RNG states for {len(saved_cuda)} CUDA devices, this "
                f"process sees {n}; restoring the first {min(n, len(saved_cuda))}",
                stacklevel=3,
            )
        for i in range(min(n, len(saved_cuda))):
            torch.cuda.set_rng_state(saved_cuda[i], i)


# ---------------------------------------------------------------------------------------------
# restore


def check_targets(
    tree: dict[str, Any], *, model=None, optimizer=None, scheduler=None, scaler=None, stateful=None
) -> None:
    """Raise CheckpointStateError if the objects cannot take the saved state; touches nothing."""
    where = f"checkpoint of step {tree.get('step')}"
    for key, obj in (
        ("model", model),
        ("optimizer", optimizer),
        ("scheduler", scheduler),
        ("scaler", scaler),
    ):
        if obj is not None and key not in tree:
            raise CheckpointStateError(
                f"{where} has no {key} state; do not pass {key}= to restore()"
            )
        if (
            obj is not None
            and key != "model"
            and not callable(getattr(obj, "load_state_dict", None))
        ):
            raise CheckpointStateError(f"{key} ({type(obj).__name__}) has no load_state_dict()")
    if model is not None:
        saved = tree["model"]
        if not isinstance(saved, dict):
            raise CheckpointCorruptError(f"{where}: model state is not a mapping")
        target = {canonical_key(k): v for k, v in unwrap_model(model).state_dict().items()}
        missing, unexpected = sorted(set(target) - set(saved)), sorted(set(saved) - set(target))
        if missing or unexpected:
            raise CheckpointStateError(
                f"{where} does not match the model: missing keys "
                f"{missing[:5]}, unexpected keys {unexpected[:5]}"
            )
        for k, t in target.items():
            s = saved[k]
            if isinstance(t, torch.Tensor) and (
                not isinstance(s, torch.Tensor) or tuple(s.shape) != tuple(t.shape)
            ):
                raise CheckpointStateError(
                    f"{where}: model key {k!r} has shape "
                    f"{tuple(getattr(s, 'shape', ()))}, the model has {tuple(t.shape)}"
                )
    if optimizer is not None:
        groups = (
            tree["optimizer"].get("param_groups") if isinstance(tree["optimizer"], dict) else None
        )
        if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
        ):
            raise CheckpointCorruptError(f"{where}: optimizer state has no param_groups")
        saved_sizes = [len(g["params"]) for g in groups]
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        if saved_sizes != sizes:
            raise CheckpointStateError(
                f"{where}: optimizer param groups have sizes "
                f"{saved_sizes}, the optimizer has {sizes}"
            )
    if "rng" in tree:
        _check_rng(tree["rng"], where)
    for name, obj in (stateful or {}).items():
        if name not in tree.get("stateful", {}):
            raise CheckpointStateError(
                f"{where} has no stateful object {name!r} (saved: "
                f"{sorted(tree.get('stateful', {}))})"
            )
        if not callable(getattr(obj, "load_state_dict", None)):
            raise CheckpointStateError(
                f"stateful[{name!r}] ({type(obj).__name__}) has no load_state_dict()"
            )


def _check_rng(state: Any, where: str) -> None:
    """Load the saved RNG states into throwaway generators, so a bad one fails before anything is
    touched."""
    try:
        random.Random().setstate(state["python"])
        torch.Generator().set_state(state["torch"])
        np = _numpy()
        if np is not None and "numpy" in state:
            np.random.RandomState().set_state(state["numpy"])
        cuda = state.get("cuda", [])
        if not isinstance(cuda, list) or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda
        ):
            raise ValueError("CUDA RNG states must be a list of uint8 tensors")
        if cuda and torch.cuda.is_available():
            # torch.cuda.set_rng_state checks the size only when it runs, after the model and
            # optimizer were loaded (or, before CUDA is initialized, later still): check it now
            for i, t in enumerate(cuda[: torch.cuda.device_count()]):
                want = torch.cuda.get_rng_state(i).numel()
                if t.numel() != want:
                    raise ValueError(
                        f"CUDA RNG state {i} has {t.numel()} bytes, this torch's has {want}"
                    )
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointCorruptError(f"{where}: saved RNG state is invalid: {exc}") from None


def apply(
    tree: dict[str, Any],
    *,
    model=None,
    optimizer=None,
    scheduler=None,
    scaler=None,
    stateful=None,
    extra=None,
    rng: bool = True,
) -> None:
    """Load a decoded, verified and checked tree into the objects (RNG last, so nothing after it
    consumes random numbers before training continues)."""
    if model is not None:
        model = unwrap_model(model)
        names = {canonical_key(k): k for k in model.state_dict()}
        model.load_state_dict({names[k]: v for k, v in tree["model"].items()}, strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(tree["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(tree["scheduler"])
    if scaler is not None:
        scaler.load_state_dict(tree["scaler"])
    for name, obj in (stateful or {}).items():
        obj.load_state_dict(tree["stateful"][name])
    if extra is not None:
        extra.update(tree.get("extra") or {})
    if rng and "rng" in tree:
        set_rng_state(tree["rng"])
