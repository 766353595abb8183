"""A checkpoint directory with many blocks (issue #25): a good plain checkpoint whose shard
manifest gains a (1, N) uint8 global tensor ``extra.t`` made of N one-byte blocks ``extra.t.{j}``
that tile it, each at its aligned place in a sparse data file of its own, every CRC valid. Shared
by tests/checkpoint/test_many_blocks.py and benchmarks/bench_verify_blocks.py."""

from __future__ import annotations

from pathlib import Path

import google_crc32c
import torch
from torch import nn

import gpumem
from gpumem.checkpoint.storage import format

STEP = "step-000000001"
BLOCKS_FILE = "data-r00000-0009.bin"


def save_small(root: Path) -> Path:
    """One small good checkpoint (a Linear and AdamW) in ``root``; returns its step directory."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    with gpumem.Checkpointer(root, keep=None) as ck:
        ck.save(1, model=model, optimizer=opt, rng=False, blocking=True)
        ck.wait()
    return root / STEP


def _rewrite(path: Path, body: dict, version: int) -> int:
    raw, crc = format.encode_manifest(body, version)
    path.write_bytes(raw)
    return crc


def _read(path: Path) -> dict:
    body, _, _ = format.decode_manifest(path.read_bytes(), str(path))
    return body


def forge_blocks(step: Path, n: int, values: bytes | None = None) -> bytes:
    """Add the N-block tensor ``extra.t`` to ``step`` (see the module docs); returns its bytes.
    Block j's byte sits at offset j * alignment of its own data file (a hole elsewhere)."""
    values = values if values is not None else bytes((7 * j + 1) % 256 for j in range(n))
    shard_path = step / format.shard_manifest_name(0)
    body = _read(shard_path)
    align = body["alignment"]
    size = (n - 1) * align + 1
    body["files"][BLOCKS_FILE] = size
    crcs = [google_crc32c.value(bytes([b])) for b in values]
    body["tensors"] += [
        {
            "name": f"extra.t.{j}",
            "dtype": "uint8",
            "shape": [1, 1],
            "nbytes": 1,
            "crc32c": [crcs[j]],
            "extents": [[BLOCKS_FILE, j * align, 1]],
            "global": {"shape": [1, n], "offsets": [0, j], "tensor": "extra.t"},
        }
        for j in range(n)
    ]
    body.setdefault("meshes", [])
    body["state"]["extra"] = {"t": {"__dtensor__": "extra.t"}}
    crc = _rewrite(shard_path, body, format.SHARDED_VERSION)
    with open(step / BLOCKS_FILE, "wb") as f:
        f.truncate(size)
        for j, b in enumerate(values):
            f.seek(j * align)
            f.write(bytes([b]))
    main = _read(step / format.MAIN_MANIFEST)
    main["shards"][0]["crc32c"] = crc
    main["shards"][0]["nbytes"] = sum(t["nbytes"] for t in body["tensors"])
    main["sharded"] = True
    _rewrite(step / format.MAIN_MANIFEST, main, format.SHARDED_VERSION)
    (step.parent / format.LATEST).unlink(missing_ok=True)
    return values
