"""One save() and one restore() go through the storage seam in the order its docstring numbers
(``gpumem/checkpoint/storage/backend.py``), on a directory and on an object store alike, and
only through the members its Protocols declare (issue "The house, step 3").

A profiler hook records every call that crosses into ``gpumem.checkpoint.storage`` from outside
it, on every thread (the commit runs on the persist thread): a method called on a storage object
must be a member of a declared Protocol, and the methods come in the numbered order; the only
module functions the other stages call there are the manifest readers and the format's.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest
import torch

import gpumem
from gpumem.checkpoint.storage.backend import Candidates, SaveCommit, StorageRoot
from gpumem.checkpoint.storage.step_reads import StepFiles, StepPath

STORAGE = "gpumem.checkpoint.storage"
FORMAT = "gpumem.checkpoint.storage.format"
DUNDERS = {"__enter__", "__exit__", "__truediv__", "__fspath__"}
DECLARED = {
    name
    for proto in (StorageRoot, SaveCommit, Candidates, StepFiles, StepPath)
    for name in vars(proto)
    if not name.startswith("_") or name in DUNDERS
} | {"__str__"}  # a step's path printed in a message
PATH_MEMBERS = {*vars(StepPath), "__str__"}
# what restore/ may call in storage besides the Protocols' methods: decoding manifests
READERS = {"load_info", "load_shard_manifest"}


def _crossings(run: Callable[[], object]) -> list[tuple[str, str, str]]:
    """(kind, module, name) of every call into storage from outside it while ``run`` runs:
    kind "method" (a ``self`` call), "function", or "data" (the format's value types)."""
    seen: list[tuple[str, str, str]] = []

    def hook(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if not module.startswith(STORAGE) or caller.startswith(STORAGE):
            return
        if not caller.startswith("gpumem.checkpoint"):
            return  # the garbage collector's __del__, a test's own call
        name = frame.f_code.co_name
        if name in ("__init__", "__del__") or name.startswith("<"):
            return
        # the format's value types (TensorEntry.torch_dtype) are what the seam passes, not it
        kind = "data" if module == FORMAT else "method" if "self" in frame.f_locals else "function"
        seen.append((kind, module, name))

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


def _state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def _methods(seen: list[tuple[str, str, str]]) -> list[str]:
    """The method names in order, repeats of one call in a row folded (a path named in a
    message is not a step of the sequence)."""
    out: list[str] = []
    for kind, _, name in seen:
        if name in PATH_MEMBERS:
            continue
        if kind == "method" and (not out or out[-1] != name):
            out.append(name)
    return out


def _check_seam(ck: gpumem.Checkpointer) -> None:
    model, opt = _state(0)
    saved = _crossings(lambda: (ck.save(1, model=model, optimizer=opt), ck.wait()))
    undeclared = {n for k, _, n in saved if k == "method"} - DECLARED
    assert not undeclared, f"save() calls storage outside the seam: {undeclared}"
    assert [n for k, _, n in saved if k == "function"] == []
    # steps 1-4 of a save, each once, in order
    assert _methods(saved) == ["check_writable", "commit", "run", "close"]

    fresh, fresh_opt = _state(1)
    restored = _crossings(lambda: ck.restore(model=fresh, optimizer=fresh_opt))
    undeclared = {n for k, _, n in restored if k == "method"} - DECLARED
    assert not undeclared, f"restore() calls storage outside the seam: {undeclared}"
    assert {n for k, _, n in restored if k == "function"} <= READERS
    order = _methods(restored)
    # steps 1-3 of a restore: the candidates, the pointer checked, listed, one step opened...
    assert order[:4] == ["candidates", "check_pointer", "names", "open"], order
    # ... its data files' sizes checked before any byte of them is read
    reads = [n for n in order if n in ("check_size", "read_file", "read_spans")]
    assert reads and reads[0] == "check_size", order
    assert "read_file" in reads or "read_spans" in reads
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_directory_save_and_restore_follow_the_seam(tmp_path):
    with gpumem.Checkpointer(tmp_path / "ckpt") as ck:
        _check_seam(ck)


def test_the_tracer_sees_a_call_outside_the_seam(tmp_path, monkeypatch):
    """The check can fail: a stage that reaches past the Protocols into a backend is seen."""
    import types

    from gpumem.checkpoint.storage import root as root_module

    def private(self) -> str:
        return "reached"

    def stage(ck) -> str:
        return ck._root.private()

    # the backend's method lives in storage.root, the caller in a checkpoint stage
    method = types.FunctionType(private.__code__, vars(root_module), "private")
    caller = types.FunctionType(stage.__code__, {"__name__": "gpumem.checkpoint.a_stage"})
    monkeypatch.setattr(root_module.Root, "private", method, raising=False)
    with gpumem.Checkpointer(tmp_path / "ckpt") as ck:
        seen = _crossings(lambda: caller(ck))
    assert seen == [("method", "gpumem.checkpoint.storage.root", "private")]
    assert {n for _, _, n in seen} - DECLARED == {"private"}


def test_an_object_store_save_and_restore_follow_the_seam(s3_server, s3_bucket):
    pytest.importorskip("boto3", reason="the object-store tests need boto3 (gpumem[s3])")
    from s3_lib import CREDENTIALS, env

    with env(CREDENTIALS):
        ck = gpumem.Checkpointer(
            f"s3://{s3_bucket}/seam", endpoint_url=s3_server.url, overlap=False
        )
    with ck:
        _check_seam(ck)
