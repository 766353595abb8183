"""Exact tracking of live tensor storages: a TorchDispatchMode plus weakref finalizers.

Every aten op that runs while the mode is active hands us its outputs; each new storage gets an
``Entry`` (bytes, category, owning module) and a weakref whose callback subtracts its bytes when
the storage dies. Storages are keyed by their Python object, which PyTorch keeps alive exactly as
long as the C++ storage (PyObject preservation), so the callback fires when the memory is freed.

What it cannot see: memory a kernel allocates internally and never returns as a tensor (library
scratch space, e.g. cuBLAS or oneDNN workspaces), and tensors created under ``no_dispatch``. The
same holds for PyTorch's own tools (MemTracker, the profiler's memory timeline).

Sizes: CPU storages count their exact ``nbytes``; CUDA storages are rounded up to the caching
allocator's 512-byte granularity, the size the allocator really hands out.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._guards import active_fake_mode as _active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from gpumem.profiler.categories import CATEGORIES, COMMUNICATION
from gpumem.profiler.fsdp_tp import has_dtensor, is_collective

CUDA_BLOCK = 512  # CUDACachingAllocator kMinBlockSize: every block is a multiple of this


class DataDependentError(RuntimeError):
    """An op whose output size depends on tensor values ran under ``gpumem.fake()``."""


def storage_bytes(st: torch.UntypedStorage, device_type: str) -> int:
    n = st.nbytes()
    if device_type == "cuda":
        return -(-n // CUDA_BLOCK) * CUDA_BLOCK
    return n


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors holding memory behind ``t``, looking through traceable wrapper subclasses.

    ``__tensor_flatten__`` may name attributes that are not tensors (DTensor names its device
    mesh): those hold no storage and are skipped."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for name in attrs:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _plain_tensors(inner)
    else:
        yield t


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure of containers (args, kwargs, optimizer state)."""
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def views_of(t: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.UntypedStorage]]:
    """``(plain tensor, its untyped storage)`` behind a tensor, looking through traceable
    wrapper subclasses."""
    for inner in _plain_tensors(t):
        try:
            yield inner, inner.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            continue


def storages_of(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The untyped storages behind a tensor, looking through traceable wrapper subclasses."""
    for _, st in views_of(t):
        yield st


_Tensor = torch.Tensor
_FakeTensor = FakeTensor
_FLAT_LEAVES = frozenset({torch.Tensor, FakeTensor, type(None), int, float, bool})
_NO_TENSOR = frozenset({torch.device, torch.dtype, torch.layout, type(None), int, float, bool})
_RESIZES: dict[Any, bool] = {}


def _may_resize(func: Any) -> bool:
    """Whether an op can change the size of an existing storage: the ``out=`` variants (they
    resize their output) and the resize/set family. In-place ops keep their storage's size."""
    m = _RESIZES.get(func)
    if m is None:
        try:
            name = func._schema.name
            m = any(
                a.alias_info is not None
                and a.alias_info.is_write
                and (a.kwarg_only or "resize" in name or "set_" in name)
                for a in func._schema.arguments
            )
        except AttributeError:  # higher-order operators have no schema: assume they may
            m = True
        _RESIZES[func] = m
    return m


def _data_dependent_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    return DataDependentOutputException, DynamicOutputShapeException


class Entry:
    """One live storage: its size, what it is, and which module it belongs to."""

    __slots__ = (
        "__weakref__",
        "born",
        "category",
        "device",
        "died",
        "hid",
        "key",
        "module",
        "nbytes",
        "ref",
    )

    def __init__(self, nbytes: int, category: str, module: str, device: str, born: int) -> None:
        self.nbytes = nbytes
        self.category = category
        self.module = module
        self.device = device
        self.born = born  # event counter at creation
        self.died: int | None = None  # event counter at free
        self.ref: weakref.ref | None = None
        self.key = 0  # id() of the storage: the key in StorageTracker.entries
        self.hid = -1  # its handle in StorageTracker.alloc_log (-1: not logged)


class StorageTracker(TorchDispatchMode):
    """Live bytes per category, updated on every op and every storage free.

    ``context`` is called once per op that creates storages and returns ``(category, module)``
    for them (outputs of collectives are ``communication`` of the running module, whatever the
    context); ``after_op`` is called after every op (the session updates its peaks there);
    ``where`` names the running module; ``on_new``, when set, receives every new entry;
    ``on_comm``, when set, receives ``(entry, delta)`` whenever the live bytes of a
    ``communication`` entry change (born, freed, resized, reclassified in or out).

    Example:
        >>> tr = StorageTracker(lambda: ("temporary", ""), lambda: None, lambda: "")
        >>> with tr:
        ...     y = torch.ones(256)            # tracked: 1024 bytes
        >>> tr.level
        1024
    """

    def __init__(
        self,
        context: Callable[[], tuple[str, str]],
        after_op: Callable[[], None],
        where: Callable[[], str],
    ) -> None:
        super().__init__()
        self._context = context
        self._after_op = after_op
        self._where = where
        self.on_new: Callable[[Entry], None] | None = None
        self.on_comm: Callable[[Entry, int], None] | None = None
        # when a list: every storage's allocation and free in order, for the caching allocator
        # simulator (gpumem.allocator): (handle, bytes, device type) on allocation, (handle, -1,
        # "") on free; a resize is an allocation of the new size, then the free of the old
        self.alloc_log: list[tuple[int, int, str]] | None = None
        self._next_hid = 0
        # not counted while set: our own bookkeeping ops (the saved-tensor detach), and DTensor's
        # sharding propagation (shape inference on fake tensors, of our own mode under fake())
        self.paused = False
        self.entries: dict[int, Entry] = {}
        self.level = 0
        self.by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.events = 0  # bumped on every op and every free: orders snapshots against frees
        self.by_device: dict[str, int] = {}
        self._orig_resize: Any = None
        self._fake_mode: Any = None
        # one bound callback for every weakref (no closure per storage: fewer objects for the
        # garbage collector to track); id(weakref) -> its entry
        self._by_ref: dict[int, Entry] = {}
        self._on_free = self._free_ref

    # -- registration -------------------------------------------------------------------------
    def lookup(self, st: torch.UntypedStorage) -> Entry | None:
        e = self.entries.get(id(st))
        if e is not None and e.ref is not None and e.ref() is st:
            return e
        return None

    def track(self, t: torch.Tensor, category: str, module: str) -> list[Entry]:
        """Start counting the storages of ``t`` (no-op for storages already tracked)."""
        out = []
        for st in storages_of(t):
            e = self.lookup(st)
            if e is None:
                e = self.add(st, t.device.type, category, module)
            out.append(e)
        return out

    def add(self, st: torch.UntypedStorage, device_type: str, category: str, module: str) -> Entry:
        n = storage_bytes(st, device_type)
        e = Entry(n, category, module, device_type, self.events)
        e.key = key = id(st)
        e.ref = ref = weakref.ref(st, self._on_free)
        self._by_ref[id(ref)] = e
        self.entries[key] = e
        self.level += n
        self.by_category[category] += n
        self.by_device[device_type] = self.by_device.get(device_type, 0) + n
        log = self.alloc_log
        if log is not None:
            e.hid = hid = self._next_hid
            self._next_hid = hid + 1
            log.append((hid, n, device_type))
        if category == COMMUNICATION and self.on_comm is not None:
            self.on_comm(e, n)
        if self.on_new is not None:
            self.on_new(e)
        return e

    def _free_ref(self, ref: weakref.ref) -> None:
        e = self._by_ref.pop(id(ref), None)
        if e is not None:
            self._free(e)

    def _free(self, e: Entry) -> None:
        key = e.key
        if self.entries.get(key) is e:
            del self.entries[key]
        self.events += 1
        e.died = self.events
        self.level -= e.nbytes
        self.by_category[e.category] -= e.nbytes
        self.by_device[e.device] -= e.nbytes
        if e.hid >= 0 and self.alloc_log is not None:
            self.alloc_log.append((e.hid, -1, ""))
        if e.category == COMMUNICATION and self.on_comm is not None:
            self.on_comm(e, -e.nbytes)

    def reclassify(self, e: Entry, category: str, module: str | None = None) -> None:
        live = e.died is None and self.on_comm is not None
        if live and e.category == COMMUNICATION:
            self.on_comm(e, -e.nbytes)
        if e.died is None and e.category != category:
            self.by_category[e.category] -= e.nbytes
            self.by_category[category] += e.nbytes
        e.category = category
        if module is not None:
            e.module = module
        if live and category == COMMUNICATION:
            self.on_comm(e, e.nbytes)

    def _resized(self, st: torch.UntypedStorage) -> None:
        e = self.lookup(st)
        if e is None:
            return
        n = storage_bytes(st, e.device)
        if n != e.nbytes and e.died is None:
            d = n - e.nbytes
            e.nbytes = n
            log = self.alloc_log
            if log is not None and e.hid >= 0:  # a new buffer, the data copied, the old freed
                old, e.hid = e.hid, self._next_hid
                self._next_hid += 1
                log.append((e.hid, n, e.device))
                log.append((old, -1, ""))
            self.level += d
            self.by_category[e.category] += d
            self.by_device[e.device] += d
            if e.category == COMMUNICATION and self.on_comm is not None:
                self.on_comm(e, d)

    # -- the mode ------------------------------------------------------------------------------
    # The hot path: one call per aten op. It allocates nothing for ops whose outputs are views of
    # storages already tracked, compares sizes only after ops that can resize (``out=``
    # variants, resize_ and set_), and handles plain tensors and fake tensors of our own mode
    # inline.
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and has_dtensor(types):
            return NotImplemented  # DTensor runs first; its local ops come back through here
        try:
            out = func(*args, **(kwargs or {}))
        except _data_dependent_errors() as exc:
            raise DataDependentError(
                f"{func} in module {self._where()!r} has an output whose size or value depends on "
                "tensor data, which fake tensors do not have; run this model for real, or make the "
                "layer follow a stated assumption under fake tensors (see gpumem.models.MoE)"
            ) from exc
        if self.paused:
            return out
        self.events += 1
        cls = type(out)
        if cls is _Tensor or cls is _FakeTensor:
            outs: Any = (out,)
        elif cls in _NO_TENSOR:  # metadata queries (prim.device, sym_size): nothing to walk
            outs = ()
        elif (cls is tuple or cls is list) and all(type(o) in _FLAT_LEAVES for o in out):
            outs = out
        else:
            outs = tree_leaves(out)
        entries = self.entries
        ctx = None
        resizes = None
        for t in outs:
            cls = type(t)
            if cls is _Tensor or (cls is _FakeTensor and t.fake_mode is self._fake_mode):
                try:
                    st = t.untyped_storage()
                except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
                    continue
                e = entries.get(id(st))
                if e is not None and e.ref() is st:
                    if resizes is None:
                        resizes = _RESIZES.get(func)
                        if resizes is None:
                            resizes = _may_resize(func)
                    if resizes and e.nbytes != storage_bytes(st, e.device):
                        self._resized(st)
                    continue
                if ctx is None:
                    ctx = self._context_of(func)
                self.add(st, t.device.type, ctx[0], ctx[1])
            elif cls is _FakeTensor or not isinstance(t, _Tensor):
                # a fake mode other than the one we started under is tracing (torch.compile,
                # DTensor sharding propagation): its tensors are not memory of this run
                continue
            else:  # tensor subclasses: count the storages of the tensors they are made of
                for inner in _plain_tensors(t):
                    if type(inner) is _FakeTensor and inner.fake_mode is not self._fake_mode:
                        continue
                    for st in storages_of(inner):
                        e = self.lookup(st)
                        if e is None:
                            if ctx is None:
                                ctx = self._context_of(func)
                            self.add(st, inner.device.type, ctx[0], ctx[1])
                        elif e.nbytes != storage_bytes(st, e.device):
                            self._resized(st)
        self._after_op()
        return out

    def _context_of(self, func: Any) -> tuple[str, str]:
        if is_collective(func):
            return COMMUNICATION, self._where()
        return self._context()

    def patch_resize(self) -> None:
        """``UntypedStorage.resize_`` bypasses the dispatcher (FSDP frees parameters this way):
        wrap it so resizes of tracked storages are counted."""
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            r = orig(st, size)
            tracker._resized(st)
            tracker._after_op()
            return r

        torch.UntypedStorage.resize_ = resize_

    def unpatch_resize(self) -> None:
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None

    def __enter__(self):
        self._fake_mode = _active_fake_mode()
        self.patch_resize()
        try:
            return super().__enter__()
        except BaseException:
            self.unpatch_resize()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.unpatch_resize()
