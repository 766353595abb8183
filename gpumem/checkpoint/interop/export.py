"""Consolidated model weights out of a checkpoint, as sharded safetensors with an index.

    gpumem ckpt export ckpts --format safetensors --out hf_model --config config.json --dtype bf16

The model's tensors are taken from a checkpoint written by ``Checkpointer`` (its ``model``
section) or through ``gpumem.dcp`` (items under ``model.``), however they were sharded: each is
assembled from the blocks that hold it, every chunk's CRC32C verified, cast if asked, and
written out before the next is read, so memory stays near the largest tensor. Wrapper prefixes
are stripped from the names (``_orig_mod.``, ``_fsdp_wrapped_module.``,
``_checkpoint_wrapped_module.``, a leading ``module.``). Files are
``model-0000k-of-0000n.safetensors`` of at most ``max_shard_bytes`` each (a larger tensor gets
a file of its own) plus ``model.safetensors.index.json``, written under temporary names and
renamed once complete; with ``config`` the directory loads with
``transformers.AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..capture.boxes import Box
from ..errors import CheckpointCorruptError, CheckpointStateError
from ..restore.reshard import GlobalIndex, Reader, SavedBlock, data_files
from ..storage import directory
from ..storage.directory import load_shard_manifest
from ..storage.format import MAIN_MANIFEST
from ..storage.safe_fs import Dir, io_threads
from .dcp_items import DCP_KEY, load_items, open_step_dir

_WRAPPERS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    **{
        getattr(torch, n): s
        for n, s in (
            ("uint16", "U16"),
            ("uint32", "U32"),
            ("uint64", "U64"),
            ("float8_e4m3fn", "F8_E4M3"),
            ("float8_e5m2", "F8_E5M2"),
        )
        if hasattr(torch, n)
    },
}
INDEX = "model.safetensors.index.json"


def clean_key(key: str) -> str:
    """``key`` without wrapper components and a leading ``module.`` (DDP, DataParallel)."""
    for w in _WRAPPERS:
        key = key.replace(w, "")
    while key.startswith("module."):
        key = key[len("module.") :]
    return key


@dataclasses.dataclass
class Weight:
    """One model tensor: its (cleaned) key, saved dtype and shape, the blocks holding it, and
    the dtype to write."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    blocks: list[SavedBlock]
    out_dtype: torch.dtype | None = None

    @property
    def out_bytes(self) -> int:
        n = (self.out_dtype or self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


def model_weights(src: Any) -> tuple[Dir, list[Weight], dict[str, int]]:
    """The step directory read (open), its model tensors in saved order, and the sizes of its
    data files (from the manifests; no data read). ``src`` is a path, or a step of an object
    store opened already (``storage.s3.object_files.ObjectFiles``: read by ranged GETs)."""
    step = open_step_dir(Path(src)) if isinstance(src, str | os.PathLike) else src
    step_dir = step.path
    body, _, _ = directory.read_manifest(step, MAIN_MANIFEST)
    if DCP_KEY in body:
        layout = load_items(step_dir)
        fqns = [f for f, item in layout.items.items() if not item.is_bytes]
        model = [f for f in fqns if f.startswith("model.")]
        if not model:
            raise CheckpointStateError(
                f"{step_dir}: no items under 'model.' (it holds {sorted(fqns)[:5]}): save the "
                "model's state dict under the key 'model'"
            )
        weights = [
            Weight(
                f[len("model.") :],
                layout.items[f].dtype,
                layout.items[f].global_shape,
                [c.block for c in layout.items[f].blocks],
            )
            for f in model
        ]
        return layout.dir, _cleaned(weights, step_dir), layout.files
    info = directory.load_info(step)
    shards = [load_shard_manifest(step, info, r) for r in range(info.world_size)]
    index = GlobalIndex(step_dir, shards)
    state = shards[0].state if isinstance(shards[0].state, dict) else {}
    tree = state.get("model")
    if not isinstance(tree, dict):
        raise CheckpointStateError(f"{step_dir}: holds no model state")
    weights = []
    for key, node in tree.items():
        if not isinstance(node, dict) or len(node) != 1:
            continue  # a non-tensor value (a module's extra state): not a weight
        tag, name = next(iter(node.items()))
        if not isinstance(name, str):
            raise CheckpointCorruptError(f"{step_dir}: model key {key!r} is malformed")
        if tag == "__dtensor__" and name in index:
            blocks = index.check(name)
        elif tag == "__tensor__":
            owner = shards[0].owners.get(name, 0)
            entry = next((e for e in shards[owner].tensors if e.name == name), None)
            if entry is None:
                raise CheckpointCorruptError(f"{step_dir}: model key {key!r} has no tensor")
            blocks = [SavedBlock(owner, entry, Box.full(entry.shape), shards[owner].chunk_bytes)]
        else:
            continue
        weights.append(Weight(key, blocks[0].entry.torch_dtype, blocks[0].box.global_shape, blocks))
    return step, _cleaned(weights, step_dir), data_files(step_dir, shards)


def _cleaned(weights: list[Weight], step_dir: Path) -> list[Weight]:
    seen: dict[str, str] = {}
    for w in weights:
        key = clean_key(w.key)
        if key in seen:
            raise CheckpointStateError(
                f"{step_dir}: {seen[key]!r} and {w.key!r} are both {key!r} once wrapper "
                "prefixes are stripped"
            )
        seen[key] = w.key
        w.key = key
    return weights


def export_safetensors(
    src: Any,
    out: str | os.PathLike,
    *,
    config: str | os.PathLike | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
) -> list[Path]:
    """Write the model weights of the checkpoint ``src`` to ``out`` (see the module docs).

    Returns:
        The files written (shards, index, config).

    Raises:
        CheckpointCorruptError: a chunk fails its CRC32C (nothing is renamed into place).
        CheckpointStateError: no model state, an unknown ``dtype``, a bad ``config``.
    """
    cast = None
    if dtype is not None:
        if dtype not in DTYPES:
            raise CheckpointStateError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
        cast = DTYPES[dtype]
    step, weights, sizes = model_weights(src)
    for w in weights:
        w.out_dtype = cast if cast is not None and w.dtype.is_floating_point else w.dtype
        if w.out_dtype not in _ST_DTYPES:
            raise CheckpointStateError(f"{w.key}: dtype {w.dtype} has no safetensors name")
    config_text = None
    if config is not None:
        try:
            config_text = Path(config).read_text()
            json.loads(config_text)
        except (OSError, ValueError) as exc:
            raise CheckpointStateError(
                f"--config {config}: not a readable JSON file ({exc})"
            ) from None
    groups: list[list[Weight]] = [[]]
    size = 0
    for w in weights:
        n = w.out_bytes
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(w)
        size += n
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    files: dict[str, Path] = {}
    weight_map, total = {}, 0
    try:
        for name, group in zip(names, groups, strict=True):
            tmp = out / f".{name}.tmp"
            files[name] = tmp
            total += _write_file(tmp, group, step, sizes)
            weight_map.update((w.key, name) for w in group)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        files[INDEX] = out / f".{INDEX}.tmp"
        files[INDEX].write_text(json.dumps(index, indent=2) + "\n")
        if config_text is not None:
            files["config.json"] = out / ".config.json.tmp"
            files["config.json"].write_text(config_text)
        written = []
        for name, tmp in files.items():
            os.replace(tmp, out / name)
            written.append(out / name)
        return written
    finally:
        for tmp in files.values():
            if tmp.exists():
                tmp.unlink()


def _write_file(path: Path, group: list[Weight], step: Dir, sizes: dict[str, int]) -> int:
    """One safetensors file: the header, then each tensor read, verified and cast in turn."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for w in group:
        n = w.out_bytes
        header[w.key] = {
            "dtype": _ST_DTYPES[w.out_dtype or w.dtype],
            "shape": list(w.shape),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for w in group:
            buf = torch.empty(w.shape, dtype=w.dtype)
            reader = Reader(step)
            reader.add(w.key, buf, Box.full(w.shape), w.blocks)
            reader.run(sizes, io_threads())
            out = buf.to(w.out_dtype) if w.out_dtype not in (None, w.dtype) else buf
            if out.numel():
                f.write(memoryview(out.contiguous().view(-1).view(torch.uint8).numpy()))
            del buf, out
        f.flush()
        os.fsync(f.fileno())
    return pos
