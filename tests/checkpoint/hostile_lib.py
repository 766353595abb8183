"""Shared by the tests of issue #14 (hostile directories, restore as a transaction, errors): small
training objects, two good checkpoints of them, a restore that records its warnings, a forger
that rewrites a manifest with valid CRCs, and peak-memory probes."""

from __future__ import annotations

import stat
import warnings
from pathlib import Path

import google_crc32c
import pytest
import torch
from ckpt_files import encode_manifest, read_manifest
from torch import nn

import gpumem
from gpumem.checkpoint import CheckpointFallbackWarning

STEP1, STEP2 = "step-000000001", "step-000000002"
DATA = "data-r00000-0000.bin"


def objects(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    model(torch.randn(6, 8)).sum().backward()
    opt.step()
    return model, opt


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list:
    """Everything restore could change, as comparable values (tensors as bytes)."""

    def flat(x):
        if isinstance(x, torch.Tensor):
            return ("t", str(x.dtype), tuple(x.shape), x.detach().cpu().numpy().tobytes())
        if isinstance(x, dict):
            return sorted((str(k), flat(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return [flat(v) for v in x]
        return x

    return [flat(model.state_dict()), flat(opt.state_dict())]


def two_steps(root: Path) -> dict[int, list]:
    """Steps 1 and 2 of different objects; returns each step's snapshot."""
    want = {}
    with gpumem.Checkpointer(root, keep=None) as ck:
        for step in (1, 2):
            model, opt = objects(step)
            ck.save(step, model=model, optimizer=opt)
            ck.wait()
            want[step] = snapshot(model, opt)
    return want


def restore(root: Path, **kw) -> tuple[int | None, list, list[str]]:
    """Restore into fresh objects; (step, snapshot of the objects, fallback warning texts: the
    skipped checkpoints', then the latest pointer's)."""
    model, opt = objects(99)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with gpumem.Checkpointer(root, keep=None) as ck:
            step = ck.restore(model=model, optimizer=opt, **kw)
    texts = [str(w.message) for w in seen if issubclass(w.category, CheckpointFallbackWarning)]
    texts.sort(key=lambda t: not t.startswith("skipping"))
    return step, snapshot(model, opt), texts


def forge(step_dir: Path, mutate) -> None:
    """Rewrite the shard manifest with ``mutate(body)`` applied and every CRC recomputed (the
    main manifest records the new shard CRC): only the values are hostile, the framing is
    valid."""
    body, _ = read_manifest(step_dir / "manifest-r00000")
    mutate(body)
    raw, crc = encode_manifest(body)
    (step_dir / "manifest-r00000").write_bytes(raw)
    main, _ = read_manifest(step_dir / "MANIFEST")
    main["shards"][0]["crc32c"] = crc
    (step_dir / "MANIFEST").write_bytes(encode_manifest(main)[0])


def framed(payload: bytes) -> bytes:
    prefix = f"gpumem-checkpoint 1 {len(payload):012d} ".encode()
    return prefix + f"{google_crc32c.value(prefix + payload):08x}\n".encode() + payload


def peak_rss_reset() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def nobody_can_enter(path: Path) -> None:
    path.chmod(0o755)
    for parent in path.parents:
        if parent == Path("/"):
            break
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            pytest.skip(f"{parent} is not searchable by other users")
