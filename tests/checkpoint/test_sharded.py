"""Sharded (DTensor) state on CPU with gloo: FSDP2, tensor parallel and 2-D meshes saved by one
world and restored bit-exact by another.

Three spawns, in order (the module fixture), then this process:

- 4 ranks: FSDP(4) saves ``f4``; a fresh FSDP(2)×TP(2) model restores it (FSDP(4) -> 2-D), trains
  a step and saves ``twod``;
- 2 ranks: a fresh FSDP(2) model restores ``f4`` (4 -> 2), trains and saves ``fsdp`` in overlap
  mode, stepping the optimizer right after save() (the hook must keep the step off the copy);
  TP(2) saves ``tp``; CPU offload saves and restores ``offload``; then what must fail: a save or
  restore on rank 0 only (named within collective_timeout_s), ranks saving different steps, a
  DTensor only one rank holds, and a directory lock that rank 0 waits for (not a timeout);
- 3 ranks: restore ``fsdp`` (2 -> 3) and ``f4`` (4 -> 3);
- this process: restore ``fsdp`` and ``twod`` into the plain model (sharded -> unsharded, 2 -> 1),
  and the refusals (dtype, global shape) that must leave the model untouched.

Every rank compares what it restored with the saving job's full tensors (``full_state``) bit for
bit. chunk_bytes=4096 makes the blocks cross chunks at odd offsets; TP splits a weight along
dimension 1, so its blocks are not contiguous in the global tensor.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ckpt_files import read_manifest
from sharded_lib import build, differences, full_state, train

import gpumem
from gpumem.checkpoint import CheckpointError, CheckpointStateError, verify
from gpumem.checkpoint.capture.dtensor import sharding_supported

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not sharding_supported(),
    reason="needs torch.distributed and torch >= 2.6 (public fully_shard)",
)

CHUNK = 4096


def _init(rank: int, world: int, root: str, tag: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rdzv-{tag}", rank=rank, world_size=world
    )


def _done(root: str, tag: str, rank: int, out: dict) -> None:
    Path(root, f"{tag}.{rank}.json").write_text(json.dumps(out))
    dist.barrier()  # no rank tears its gloo pairs down while a peer still talks
    dist.destroy_process_group()


def _ckpt(root: str, name: str, **kw) -> gpumem.Checkpointer:
    return gpumem.Checkpointer(f"{root}/{name}", chunk_bytes=CHUNK, **kw)


def _restore_check(root: str, name: str, layout: str, ref_file: str, **build_kw) -> dict:
    """Restore checkpoint ``name`` into a fresh ``layout`` model; compare with the reference."""
    model, opt = build(layout, seed=99, **build_kw)
    train(model, opt, 1, start=50)  # optimizer state exists, with other values everywhere
    with _ckpt(root, name) as ck:
        step = ck.restore(model=model, optimizer=opt)
        read, needed = ck.last_restore.bytes_read, ck.last_restore.bytes_needed
    diff = differences(torch.load(f"{root}/{ref_file}"), full_state(model, opt))
    return {"step": step, "diff": diff, "read": read, "needed": needed}


def _save_ref(root: str, name: str, model, opt, rank: int) -> None:
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, f"{root}/{name}")


# ------------------------------------------------------------------------------ 4 ranks


def _four(rank: int, world: int, root: str) -> None:
    _init(rank, world, root, "four")
    out: dict = {}
    model, opt = build("fsdp")
    train(model, opt, 2)
    _save_ref(root, "f4.pt", model, opt, rank)
    with _ckpt(root, "f4") as ck:
        out["f4_mode"] = ck.save(2, model=model, optimizer=opt).mode
    out["to_2d"] = _restore_check(root, "f4", "2d", "f4.pt", dp=2)
    model, opt = build("2d", seed=7, dp=2)
    with _ckpt(root, "f4") as ck:
        ck.restore(model=model, optimizer=opt)
    train(model, opt, 1, start=2)
    _save_ref(root, "twod.pt", model, opt, rank)
    with _ckpt(root, "twod") as ck:
        ck.save(3, model=model, optimizer=opt)
    _done(root, "four", rank, out)


# ------------------------------------------------------------------------------ 2 ranks


def _two(rank: int, world: int, root: str) -> None:
    _init(rank, world, root, "two")
    out: dict = {"from_f4": _restore_check(root, "f4", "fsdp", "f4.pt")}

    # overlap mode: the optimizer steps right after save(); the checkpoint holds the state
    # before that step
    model, opt = build("fsdp")
    with _ckpt(root, "f4") as ck:
        ck.restore(model=model, optimizer=opt)
    train(model, opt, 2, start=2)
    _save_ref(root, "fsdp.pt", model, opt, rank)
    with _ckpt(root, "fsdp") as ck:
        stats = ck.save(4, model=model, optimizer=opt)
        train(model, opt, 1, start=4)
        ck.wait()
        out["fsdp_mode"] = stats.mode
    out["fsdp_same_world"] = _restore_check(root, "fsdp", "fsdp", "fsdp.pt")

    model, opt = build("tp")
    train(model, opt, 2)
    _save_ref(root, "tp.pt", model, opt, rank)
    with _ckpt(root, "tp") as ck:
        ck.save(2, model=model, optimizer=opt)
    out["tp_same_world"] = _restore_check(root, "tp", "tp", "tp.pt")

    model, opt = build("offload")
    train(model, opt, 2)
    _save_ref(root, "offload.pt", model, opt, rank)
    with _ckpt(root, "offload") as ck:
        ck.save(2, model=model, optimizer=opt)
    out["offload"] = _restore_check(root, "offload", "offload", "offload.pt")

    out.update(_failures(rank, root, model, opt))
    _done(root, "two", rank, out)


def _failures(rank: int, root: str, model, opt) -> dict:
    out: dict = {}
    # save() on rank 0 only (the Lightning CheckpointIO / HF main-process pattern)
    t0 = time.monotonic()
    with _ckpt(root, "rank0only", collective_timeout_s=2) as ck:
        if rank == 0:
            ck.save(1, model=model, optimizer=opt)
            try:
                ck.wait()
            except CheckpointStateError as exc:
                out["rank0_save"] = str(exc)
            out["rank0_save_s"] = time.monotonic() - t0
    dist.barrier()
    with _ckpt(root, "rank0only", collective_timeout_s=2) as ck:
        if rank == 0:
            try:
                ck.restore(model=model, optimizer=opt)
            except CheckpointStateError as exc:
                out["rank0_restore"] = str(exc)
    dist.barrier()

    # ranks disagree about the step: every rank fails, nothing is written
    with _ckpt(root, "steps") as ck:
        ck.save(7 + rank, model=model, optimizer=opt)
        try:
            ck.wait()
        except CheckpointStateError as exc:
            out["steps"] = str(exc)

    # a DTensor only rank 1 saves: its blocks do not cover it, so nothing is committed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (2,)), [Shard(0)])
    with _ckpt(root, "tensors") as ck:
        ck.save(1, model=model, optimizer=opt, extra={"w": w} if rank == 1 else {})
        try:
            ck.wait()
        except CheckpointStateError as exc:
            out["tensors"] = str(exc)

    # rank 0 waits for the directory lock of a job being replaced, longer than the collective
    # deadline: rank 1 waits for its result first, then both restore
    lockdir = Path(root, "fsdp")
    if rank == 0:
        fd = os.open(lockdir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        threading.Timer(3.0, os.close, args=(fd,)).start()
    dist.barrier()
    t0 = time.monotonic()
    with _ckpt(root, "fsdp", collective_timeout_s=1, lock_timeout_s=30) as ck:
        out["after_lock_step"] = ck.restore(model=model, optimizer=opt)
    out["after_lock_s"] = time.monotonic() - t0
    return out


# ------------------------------------------------------------------------------ 3 ranks


def _three(rank: int, world: int, root: str) -> None:
    _init(rank, world, root, "three")
    out = {
        "from_fsdp": _restore_check(root, "fsdp", "fsdp", "fsdp.pt"),
        "from_f4": _restore_check(root, "f4", "fsdp", "f4.pt"),
        "from_plain": _restore_check(root, "plain", "fsdp", "plain.pt"),
    }
    _done(root, "three", rank, out)


# ------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    model, opt = build("plain", seed=3)  # a one-process plain checkpoint, for 1 -> FSDP(3)
    train(model, opt, 2)
    torch.save(full_state(model, opt), root / "plain.pt")
    with _ckpt(str(root), "plain") as ck:
        ck.save(2, model=model, optimizer=opt)
    results = {}
    for tag, fn, world in (("four", _four, 4), ("two", _two, 2), ("three", _three, 3)):
        mp.spawn(fn, args=(world, str(root)), nprocs=world, join=True)
        results[tag] = [json.loads((root / f"{tag}.{r}.json").read_text()) for r in range(world)]
    return root, results


def _exact(result: dict, step: int) -> None:
    assert result["step"] == step and result["diff"] == [], result


def test_fsdp4_to_fsdp2_x_tp2_and_back(run):
    _, res = run
    for r in res["four"]:
        assert r["f4_mode"] == "overlap"
        _exact(r["to_2d"], 2)
    for r in res["two"]:  # 4 -> 2
        _exact(r["from_f4"], 2)
    for r in res["three"]:  # 4 -> 3
        _exact(r["from_f4"], 2)


def test_fsdp2_to_2_and_3_ranks(run):
    _, res = run
    for r in res["two"]:
        assert r["fsdp_mode"] == "overlap"  # the state before the step after save()
        _exact(r["fsdp_same_world"], 4)
    for r in res["three"]:
        _exact(r["from_fsdp"], 4)


def test_tensor_parallel_and_cpu_offload(run):
    _, res = run
    for r in res["two"]:
        _exact(r["tp_same_world"], 2)
        _exact(r["offload"], 2)


def test_each_rank_reads_only_what_it_needs(run):
    """FSDP(2) -> FSDP(2): each rank's blocks are exactly what it needs: it reads exactly those
    bytes. 4 -> 2: each rank's shard overlaps two saved blocks per tensor; at most one partial
    chunk more at each end of each overlap (18 DTensors: 6 parameters, 2 AdamW moments each)."""
    _, res = run
    for r in res["two"]:
        same = r["fsdp_same_world"]
        assert same["read"] == same["needed"] > 0
        other = r["from_f4"]
        assert other["needed"] <= other["read"] <= other["needed"] + 18 * 2 * 2 * CHUNK


def test_manifest_records_global_blocks(run):
    """Each rank's entry of a DTensor names its block (offsets, local shape), the global shape,
    the mesh and the placements; replicated blocks (TP's row-parallel bias) are written once."""
    root, _ = run
    step = root / "tp" / "step-000000002"
    bodies = [read_manifest(step / f"manifest-r{r:05d}")[0] for r in range(2)]
    entries = [{t["name"]: t for t in b["tensors"]} for b in bodies]
    w0 = [e["model.0.weight"] for e in entries]  # column parallel: rows split
    assert [t["global"]["offsets"] for t in w0] == [[0, 0], [48, 0]]
    assert all(t["shape"] == [48, 64] and t["global"]["shape"] == [96, 64] for t in w0)
    assert all(t["global"]["placements"] == ["S(0)"] for t in w0)
    w2 = [e["model.2.weight"] for e in entries]  # row parallel: columns split
    assert [t["global"]["offsets"] for t in w2] == [[0, 0], [0, 48]]
    assert "model.2.bias" in entries[0] and "model.2.bias" not in entries[1]  # Replicate: once
    assert bodies[0]["meshes"] == [{"shape": [2], "names": ["tp"], "ranks": [0, 1]}]
    main = read_manifest(step / "MANIFEST")[0]
    assert main["sharded"] is True
    assert (step / "MANIFEST").read_bytes().startswith(b"gpumem-checkpoint 3 ")
    for name in ("tp", "fsdp", "f4", "twod", "offload"):
        info = verify(next((root / name).glob("step-*")))
        assert info.sharded


@pytest.mark.parametrize(("name", "step"), [("fsdp", 4), ("twod", 3), ("tp", 2), ("f4", 2)])
def test_sharded_to_single_plain_process(run, name, step):
    root, _ = run
    model, opt = build("plain", seed=5)
    train(model, opt, 1, start=60)
    with gpumem.Checkpointer(root / name) as ck:
        assert ck.restore(model=model, optimizer=opt) == step
    assert differences(torch.load(root / f"{name}.pt"), full_state(model, opt)) == []


def test_plain_single_process_checkpoint_restores_into_dtensors(run):
    _, res = run
    for r in res["three"]:  # 1 -> FSDP(3): one full block, cut into each rank's shard
        _exact(r["from_plain"], 2)


def test_save_on_rank0_only_is_named_not_a_hang(run):
    _, res = run
    r0 = res["two"][0]
    assert "rank(s) [1] of 2 did not join within 2 s" in r0["rank0_save"]
    assert r0["rank0_save_s"] < 30
    assert "restore(): rank(s) [1] of 2 did not join" in r0["rank0_restore"]


def test_lock_wait_does_not_count_against_the_collective_deadline(run):
    _, res = run
    for r in res["two"]:
        # rank 0 held 3 s by the lock, the collective deadline 1 s: rank 1 waited, no error
        assert r["after_lock_step"] == 4 and r["after_lock_s"] >= 2.0


def test_ranks_that_disagree_commit_nothing(run):
    root, res = run
    for r in res["two"]:
        assert "different steps (step 7 on rank(s) [0]; step 8 on rank(s) [1])" in r["steps"]
        assert "do not fit together" in r["tensors"] and "'extra.w'" in r["tensors"]
        # refused from the layouts gathered before writing, not from the manifests at commit
        assert "nothing was written" in r["tensors"] and "rank(s) [1]" in r["tensors"]
    assert not list((root / "steps").glob("step-*"))
    assert not list((root / "tensors").glob("step-*"))


def test_mismatched_model_is_refused_before_anything_changes(run):
    root, _ = run
    model, opt = build("plain", seed=5)
    before = full_state(model, opt)
    with gpumem.Checkpointer(root / "fsdp") as ck:
        with pytest.raises(CheckpointStateError, match=r"'model\.0\.weight'.*float32.*float64"):
            ck.restore(model=model.double())
        model.float()
        wide = torch.nn.Sequential(
            torch.nn.Linear(64, 95), torch.nn.ReLU(), torch.nn.Linear(95, 7), torch.nn.LayerNorm(7)
        )
        with pytest.raises(
            CheckpointStateError, match=r"global shape \(96, 64\) \(S\(0\)\).*\(95, 64\) \(plain\)"
        ):
            ck.restore(model=wide)
    assert differences(before, full_state(model, opt)) == []


def test_a_damaged_block_falls_back_for_every_reader(run, tmp_path):
    """A flipped byte in rank 1's block of the f4 checkpoint: a single process that needs it
    fails verification (no fallback here: path= names one checkpoint)."""
    import shutil

    root, _ = run
    dst = tmp_path / "f4"
    shutil.copytree(root / "f4", dst)
    data = dst / "step-000000002" / "data-r00001-0000.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0x40
    data.write_bytes(bytes(raw))
    model, opt = build("plain", seed=5)
    before = full_state(model, opt)
    with (
        gpumem.Checkpointer(dst) as ck,
        pytest.raises(CheckpointError, match="fail their CRC32C"),
    ):
        ck.restore(model=model, optimizer=opt, path=dst / "step-000000002")
    assert differences(before, full_state(model, opt)) == []


def test_export_and_inspect_a_sharded_checkpoint(run, tmp_path, capsys):
    """The 2-D checkpoint's weights assembled from four ranks' blocks into safetensors; inspect
    shows where each block lies."""
    from safetensors.torch import load_file

    from gpumem.cli import main

    root, _ = run
    out = tmp_path / "st"
    assert main(["ckpt", "export", str(root / "twod"), "--out", str(out)]) == 0
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(f))
    ref = torch.load(root / "twod.pt")
    want = {k[len("model.") :]: v for k, v in ref.items() if k.startswith("model.")}
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(root / "tp"), "--limit", "0"]) == 0
    out_text = capsys.readouterr().out
    assert "[48:96, 0:64] of (96, 64) (S(0))" in out_text
    assert "[0:7, 48:96] of (7, 96) (S(1))" in out_text


def _two_steps(root: Path, dst: Path) -> None:
    """f4's step 2 and fsdp's step 4 (the same model) in one directory."""
    import shutil

    shutil.copytree(root / "f4" / "step-000000002", dst / "step-000000002")
    shutil.copytree(root / "fsdp" / "step-000000004", dst / "step-000000004")


def test_a_symlinked_block_file_falls_back_with_every_object_untouched(run, tmp_path):
    """Hostile directories (issue #14) on the sharded path: step 4's rank-1 data file is a
    symbolic link to an outside copy of the same bytes (every CRC matches). The resharding reader
    refuses it as damage, restore falls back to step 2 with a warning, and until then nothing
    was loaded."""
    import shutil

    from gpumem.checkpoint import CheckpointCorruptError, CheckpointFallbackWarning

    root, _ = run
    dst = tmp_path / "ck"
    _two_steps(root, dst)
    data = dst / "step-000000004" / "data-r00001-0000.bin"
    shutil.copyfile(data, tmp_path / "outside.bin")
    data.unlink()
    data.symlink_to(tmp_path / "outside.bin")
    model, opt = build("plain", seed=5)
    before = full_state(model, opt)
    with gpumem.Checkpointer(dst, keep=None) as ck:
        with pytest.raises(CheckpointCorruptError, match="symbolic link"):
            ck.restore(model=model, optimizer=opt, path=dst / "step-000000004")
        assert differences(before, full_state(model, opt)) == []
        with pytest.warns(CheckpointFallbackWarning, match="step-000000004.*symbolic link"):
            assert ck.restore(model=model, optimizer=opt) == 2
    assert differences(torch.load(root / "f4.pt"), full_state(model, opt)) == []


def test_a_tensor_placed_in_another_ranks_file_is_damage_not_a_read(run, tmp_path):
    """Rank 0's shard manifest (CRCs recomputed: only the values are hostile) moves its last
    tensor into rank 1's data file, recording that file with another size than rank 1's manifest
    and the disk do (each shard's own layout checks pass). Damage, found before the bytes are
    used, and restore falls back to the older step with every object untouched until then."""
    from hostile_lib import forge

    from gpumem.checkpoint import CheckpointFallbackWarning

    root, _ = run
    dst = tmp_path / "ck"
    _two_steps(root, dst)
    step = dst / "step-000000004"
    other = "data-r00001-0000.bin"

    def mutate(body):
        entry = body["tensors"][-1]
        ((mine, offset, _),) = entry["extents"]
        entry["extents"] = [[other, 0, entry["nbytes"]]]
        body["files"][other] = entry["nbytes"]
        body["files"][mine] = offset  # its own file now ends where the tensor began

    forge(step, mutate)
    model, opt = build("plain", seed=5)
    with (
        gpumem.Checkpointer(dst, keep=None) as ck,
        pytest.warns(CheckpointFallbackWarning, match="step-000000004.*data-r0000"),
    ):
        assert ck.restore(model=model, optimizer=opt) == 2
    assert differences(torch.load(root / "f4.pt"), full_state(model, opt)) == []


def _blob(*blocks: tuple) -> bytes:
    """A layout_blob: (name, dtype, global shape, offsets, shape) per block."""
    return json.dumps([list(b) for b in blocks]).encode()


def test_layouts_that_do_not_tile_are_refused_before_writing():
    """check_layout runs on every rank on the layouts all-gathered before any byte is written:
    a gap, an overlap or a disagreeing dtype / global shape is refused by all ranks alike."""
    from gpumem.checkpoint.storage.agreement import check_layout

    top, bottom = ("w", "float32", [4, 2], [0, 0], [2, 2]), ("w", "float32", [4, 2], [2, 0], [2, 2])
    assert check_layout([_blob(top), _blob(bottom)]) is False
    # TP-style split along dimension 1: tiles too
    left, right = ("v", "float32", [2, 4], [0, 0], [2, 2]), ("v", "float32", [2, 4], [0, 2], [2, 2])
    assert check_layout([_blob(left, top), _blob(right, bottom)]) is False
    # one box written by two ranks: tiles, and its copies' CRCs are compared at commit
    assert check_layout([_blob(top, bottom), _blob(bottom)]) is True
    cases = {
        "cover 4 of its 8 elements": [_blob(top), b""],
        "overlaps rank 1's [1:3, 0:2]": [
            _blob(top, bottom),
            _blob(("w", "float32", [4, 2], [1, 0], [2, 2])),
        ],
        "float32 (4, 2) on rank 0 but bfloat16 (4, 2) on rank 1": [
            _blob(top),
            _blob(("w", "bfloat16", [4, 2], [2, 0], [2, 2])),
        ],
        "float32 (4, 2) on rank 0 but float32 (5, 2) on rank 1": [
            _blob(top),
            _blob(("w", "float32", [5, 2], [2, 0], [3, 2])),
        ],
    }
    for want, blobs in cases.items():
        with pytest.raises(CheckpointStateError, match="do not fit together") as info:
            check_layout(blobs)
        assert want in str(info.value) and "'w'" in str(info.value)
        assert "nothing was written" in str(info.value)
