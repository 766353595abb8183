"""verify and restore give the same verdict on the same bytes, and the smaller inconsistencies
the adversary of issue #25 found (finding 4): a zero-element tensor whose shape overflows, a
``__dtensor__`` reference in a plain checkpoint, a step removed by retention while a reader had
it open, a pointer read racing its atomic replacement, and the errno a rank gets when another
rank's disk filled up."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hostile_lib import forge, objects, snapshot
from torch import nn

import gpumem
from gpumem.checkpoint import CheckpointCorruptError, CheckpointIOError
from gpumem.checkpoint.restore import candidates
from gpumem.checkpoint.storage.safe_fs import Dir

STEP1, STEP2 = "step-000000001", "step-000000002"


def _two_steps(root: Path, extra: dict | None = None) -> dict[int, list]:
    want = {}
    with gpumem.Checkpointer(root, keep=None) as ck:
        for step in (1, 2):
            model, opt = objects(step)
            ck.save(step, model=model, optimizer=opt, extra=extra)
            ck.wait()
            want[step] = snapshot(model, opt)
    return want


def _restore(root: Path) -> tuple[int | None, list, list[str]]:
    model, opt = objects(9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gpumem.Checkpointer(root, keep=None) as ck:
            step = ck.restore(model=model, optimizer=opt)
    return step, snapshot(model, opt), [str(w.message) for w in caught]


def _same_verdict(root: Path, want: dict, match: str) -> None:
    """verify refuses step 2 with ``match``; restore skips it with the same message."""
    (root / "latest").unlink(missing_ok=True)
    with pytest.raises(CheckpointCorruptError, match=match) as info:
        gpumem.checkpoint.verify(root / STEP2)
    step, got, said = _restore(root)
    assert step == 1 and got == want[1]
    (skip,) = [w for w in said if "skipping damaged checkpoint step-000000002" in w]
    assert str(info.value) in skip


def test_a_zero_element_shape_that_overflows_is_refused_by_both(tmp_path):
    """(2^40, 2^40, 0) holds nothing but overflows torch's size computation: verify passed it
    and restore found it damaged. Both refuse it now, with one message."""
    want = _two_steps(tmp_path, extra={"z": torch.zeros(0, 0, 0)})

    def mutate(body):
        (entry,) = [t for t in body["tensors"] if t["name"] == "extra.z"]
        entry["shape"] = [2**40, 2**40, 0]

    forge(tmp_path / STEP2, mutate)
    _same_verdict(tmp_path, want, "overflows a tensor's size")


def test_a_dtensor_reference_in_a_plain_checkpoint_is_refused_by_both(tmp_path):
    """restore took ``{"__dtensor__": name}`` in a plain checkpoint as a plain tensor; verify
    refused it. One decoder rule now: a plain checkpoint has no global tensors."""
    want = _two_steps(tmp_path)

    def mutate(body):
        ref = body["state"]["model"]["0.weight"]
        body["state"]["model"]["0.weight"] = {"__dtensor__": ref["__tensor__"]}

    forge(tmp_path / STEP2, mutate)
    _same_verdict(tmp_path, want, "no shard holds")


def test_a_step_retention_removes_mid_read_is_named_removed_not_damaged(tmp_path, monkeypatch):
    """A reader opens step 2; a writer's retention renames it away and deletes it before the
    reader gets to its files. The reader falls back to step 1 saying the step was removed, not
    that a healthy checkpoint is damaged."""
    want = _two_steps(tmp_path)
    real = candidates._prepare

    def retention_first(step: Dir, *args):
        if step.path.name == STEP2:
            with Dir.open(tmp_path) as root:
                trash = f".trash-{STEP2}"
                root.rename(STEP2, root, trash)
                root.discard_tree(trash)
        return real(step, *args)

    monkeypatch.setattr(candidates, "_prepare", retention_first)
    step, got, said = _restore(tmp_path)
    assert step == 1 and got == want[1]
    (skip,) = [w for w in said if "step-000000002" in w and "skipping" in w]
    assert skip.startswith("skipping removed checkpoint step-000000002")
    assert "was removed while it was being read" in skip and "not damaged" in skip


def _writer_saves_while_reading(root: Path, monkeypatch, steps, keep: int) -> dict[int, list]:
    """While a reader prepares its first candidate, a writer with ``keep`` saves ``steps`` (a
    callable: the steps to save given the step being read), its retention removing what the
    reader listed. What each step saved holds."""
    saved: dict[int, list] = {}
    real = candidates._prepare

    def writer_first(step: Dir, *args):
        read = int(step.path.name.split("-")[1])
        with gpumem.Checkpointer(root, keep=keep) as ck:
            for s in steps(read):
                model, opt = objects(s)
                ck.save(s, model=model, optimizer=opt)
                ck.wait()
                saved[s] = snapshot(model, opt)
        return real(step, *args)

    monkeypatch.setattr(candidates, "_prepare", writer_first)
    return saved


def test_a_reader_racing_a_keep_2_writer_lists_again_and_takes_the_newest_step(
    tmp_path, monkeypatch
):
    """A read-only reader lists steps 2 and 1; while it reads step 2 a writer (keep=2) commits
    steps 3 and 4, its retention removing 1 and 2. Before: the reader gave up with "all 2
    checkpoints ... are damaged; newest: ... removed ..., not damaged" though newer committed
    steps stood the whole time. Now it lists again and restores step 4, the newest."""
    _two_steps(tmp_path)
    saved = _writer_saves_while_reading(
        tmp_path, monkeypatch, lambda read: (3, 4) if read == 2 else (), keep=2
    )
    model, opt = objects(9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gpumem.Checkpointer(tmp_path, read_only=True) as ck:
            step = ck.restore(model=model, optimizer=opt)
    assert step == 4 and snapshot(model, opt) == saved[4]
    said = [str(w.message) for w in caught]
    assert [w for w in said if w.startswith("skipping removed checkpoint step-000000002")]
    assert not [w for w in said if "damaged" in w.replace("not damaged", "")], said


def test_a_writer_that_removes_every_step_read_is_named_not_called_damage(tmp_path, monkeypatch):
    """A writer (keep=1) commits a newer step, removing the one being read, every time the
    reader starts one: the reader lists again a bounded number of times, then says the steps
    were removed by retention (not damaged) and what to do."""
    _two_steps(tmp_path)
    _writer_saves_while_reading(tmp_path, monkeypatch, lambda read: (read + 1,), keep=1)
    with pytest.raises(CheckpointIOError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gpumem.Checkpointer(tmp_path, read_only=True) as ck:
            ck.restore(model=objects(9)[0])
    text = str(err.value)
    assert err.value.errno == errno.EAGAIN
    assert f"listed again {candidates.MAX_RELISTS} time(s)" in text
    assert "none damaged" in text and "are damaged" not in text and "keep=" in text


_WRITER = """
import sys, torch, gpumem
root, n = sys.argv[1], int(sys.argv[2])
with gpumem.Checkpointer(root, keep=2) as ck:
    for step in range(3, 3 + n):
        ck.save(step, extra={"w": torch.full((4096,), float(step))}, rng=False, blocking=True)
print("writer done", flush=True)
"""


def _race(tmp_path: Path, restores: int) -> None:
    """A writer process saves with keep=2 as fast as it can while this process restores
    ``restores`` times read-only: every restore returns a step the writer committed, and its
    tensor is that step's (an independent reference: the value the writer stored)."""
    with gpumem.Checkpointer(tmp_path, keep=2) as ck:
        for step in (1, 2):
            ck.save(step, extra={"w": torch.full((4096,), float(step))}, rng=False)
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), str(4 * restores)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        got = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "skipping removed checkpoint" is expected here
            for _ in range(restores):
                extra: dict = {}
                with gpumem.Checkpointer(tmp_path, read_only=True) as ro:
                    step = ro.restore(extra=extra)
                assert step is not None and torch.equal(extra["w"], torch.full((4096,), step))
                got.append(step)
    finally:
        out = writer.communicate(timeout=300)[0]
    assert writer.returncode == 0, out
    assert got == sorted(got)  # newer and newer: never an older step once a newer one was seen


def _relist_worker(rank: int, world: int, root: str) -> None:
    """One of two read-only ranks: rank 0, on reaching step 2, first lets a writer process
    (keep=2) commit steps 3 and 4, which removes steps 1 and 2."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=rank, world_size=world)
    ck_dir = f"{root}/ck"
    if rank == 0:
        real = candidates._prepare
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

        def writer_first(step: Dir, *args):
            if step.path.name == STEP2:
                cmd = [sys.executable, "-c", _WRITER, ck_dir, "2"]
                subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
            return real(step, *args)

        candidates._prepare = writer_first
    extra: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gpumem.Checkpointer(ck_dir, read_only=True) as ro:
            step = ro.restore(extra=extra)
    out = {
        "step": step,
        "w": float(extra["w"][0]),
        "warned": [str(w.message)[:200] for w in caught],
    }
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_two_ranks_list_again_together_when_a_writer_removes_the_step_read(tmp_path):
    """Two read-only ranks list steps 2 and 1; while rank 0 reads step 2 a writer (keep=2)
    commits 3 and 4, removing 1 and 2. Both ranks hear step 2 was removed, list again (rank
    0's listing on both) and restore step 4, whose tensor holds 4.0 as the writer stored."""
    with gpumem.Checkpointer(tmp_path / "ck", keep=2) as ck:
        for step in (1, 2):
            ck.save(step, extra={"w": torch.full((4096,), float(step))}, rng=False)
    mp.spawn(_relist_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["step"] == 4 and got["w"] == 4.0, got
        assert any(
            w.startswith("skipping removed checkpoint step-000000002") for w in got["warned"]
        )


def test_restores_racing_a_keep_2_writer_process_all_succeed(tmp_path):
    _race(tmp_path, 8)


@pytest.mark.slow
def test_64_restores_racing_a_keep_2_writer_process_all_succeed(tmp_path):
    _race(tmp_path, 64)


def test_the_pointer_is_read_through_one_descriptor(tmp_path, monkeypatch):
    """The writer replaces ``latest`` by rename; a reader that stat'ed one file and read the
    other saw "70 bytes, expected 71". Checks and read now use the one descriptor opened: the
    old file whole, whatever replaces the name meanwhile."""
    from gpumem.checkpoint.storage import safe_fs

    old, new = b'{"a": 1}', b'{"a": 12345}'
    (tmp_path / "latest").write_bytes(old)
    real_open = os.open

    def open_then_replace(name, flags, *a, **kw):
        fd = real_open(name, flags, *a, **kw)
        (tmp_path / "latest.tmp").write_bytes(new)
        os.replace(tmp_path / "latest.tmp", tmp_path / "latest")
        return fd

    with Dir.open(tmp_path) as d:
        monkeypatch.setattr(safe_fs.os, "open", open_then_replace)
        assert d.read_small("latest", 1024, "the latest pointer") == old
    monkeypatch.setattr(safe_fs.os, "open", real_open)
    with Dir.open(tmp_path) as d:
        assert d.read_small("latest", 1024, "the latest pointer") == new


def _enospc_worker(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=rank, world_size=world)
    from gpumem.checkpoint.storage import commit

    if rank == 1:

        def full(*a, **kw):
            raise OSError(errno.ENOSPC, "No space left on device", f"{root}/ck")

        commit.write_batches = full
    model = nn.Linear(4, 4)
    out: dict = {}
    try:
        with gpumem.Checkpointer(f"{root}/ck", keep=None) as ck:
            ck.save(1, model=model)
            ck.wait()
    except CheckpointIOError as exc:
        out = {"errno": exc.errno, "message": str(exc)}
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_the_rank_whose_disk_did_not_fill_gets_the_errno_too(tmp_path):
    """Rank 1 hits ENOSPC writing its shard; rank 0 learns it from the commit's all-gather.
    Rank 0's CheckpointIOError had errno None; it now carries rank 1's ENOSPC and says so."""
    mp.spawn(_enospc_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r1["errno"] == errno.ENOSPC
    assert r0["errno"] == errno.ENOSPC
    assert "rank(s) [1] failed to write their shards (ENOSPC" in r0["message"]
    assert not any(p.name.startswith("step-") for p in (tmp_path / "ck").iterdir())


def test_pointer_reads_racing_its_replacement_are_never_torn(tmp_path):
    """A writer replaces ``latest`` by rename, alternating two sizes, while a reader reads it
    3,000 times: every read is one whole version (the race the adversary saw once in 400
    restores)."""
    import threading

    from gpumem.checkpoint.storage.directory import read_latest

    versions = [
        json.dumps({"step": s, "path": f"step-{s:09d}", "manifest_crc32c": c}).encode()
        for s, c in ((1, 7), (22, 123456789))
    ]
    (tmp_path / "latest").write_bytes(versions[0])
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            i += 1
            (tmp_path / f"t{i % 2}").write_bytes(versions[i % 2])
            os.replace(tmp_path / f"t{i % 2}", tmp_path / "latest")

    t = threading.Thread(target=writer)
    t.start()
    seen = set()
    try:
        with Dir.open(tmp_path) as d:
            for _ in range(3000):
                seen.add(read_latest(d)["step"])
    finally:
        stop.set()
        t.join()
    assert seen <= {1, 22}


def _hole(root: Path, nbytes: int) -> None:
    """Step 2 gains ``extra.hole``: ``nbytes`` of zeros in a file of its own that is one hole
    (no disk blocks), every chunk CRC valid, referenced from ``extra``."""
    import google_crc32c
    from ckpt_files import encode_manifest, read_manifest

    step = root / STEP2
    name = "data-r00000-0001.bin"

    def mutate(body):
        chunk = body["chunk_bytes"]
        zero = google_crc32c.value(b"\0" * chunk)
        body["files"][name] = nbytes
        body["tensors"].append(
            {
                "name": "extra.hole",
                "dtype": "uint8",
                "shape": [nbytes],
                "nbytes": nbytes,
                "crc32c": [zero] * (nbytes // chunk),
                "extents": [[name, 0, nbytes]],
            }
        )
        body["state"]["extra"] = {"hole": {"__tensor__": "extra.hole"}}

    forge(step, mutate)
    with open(step / name, "wb") as f:
        f.truncate(nbytes)
    main, _ = read_manifest(step / "MANIFEST")
    shard, _ = read_manifest(step / "manifest-r00000")
    main["shards"][0]["nbytes"] = sum(t["nbytes"] for t in shard["tensors"])
    (step / "MANIFEST").write_bytes(encode_manifest(main)[0])
    (root / "latest").unlink(missing_ok=True)


def test_a_sparse_file_costs_no_memory_nobody_asked_for(tmp_path):
    """Issue #25, finding 2: a manifest entry over a 1 GiB file that is one hole, with valid
    zero-chunk CRCs, referenced from ``extra``. verify() checks its every byte through a bounded
    stream (it held the whole tensor: 2.9 GB RSS at 2.5 GiB), and restore(model=, optimizer=)
    verifies it without holding it (it read ``extra`` nobody asked for); the peak RSS grows by
    less than a quarter of the hole."""
    from hostile_lib import peak_rss_reset, rss_kib

    from gpumem.checkpoint.restore.files import STREAM_BYTES

    hole = 1 << 30
    want = _two_steps(tmp_path)
    _hole(tmp_path, hole)
    if not peak_rss_reset():
        pytest.skip("this kernel does not let a process reset its peak RSS")
    before = rss_kib("VmHWM")
    info = gpumem.checkpoint.verify(tmp_path / STEP2)
    assert info.step == 2
    verify_growth = (rss_kib("VmHWM") - before) * 1024
    peak_rss_reset()
    before = rss_kib("VmHWM")
    step, got, said = _restore(tmp_path)
    restore_growth = (rss_kib("VmHWM") - before) * 1024
    assert step == 2 and got != want[1] and not said
    assert verify_growth < 2 * STREAM_BYTES + (64 << 20), verify_growth
    assert restore_growth < 2 * STREAM_BYTES + (64 << 20), restore_growth
    # the bytes are still checked: one flipped byte in the hole is found by both
    with open(tmp_path / STEP2 / "data-r00000-0001.bin", "r+b") as f:
        f.seek(hole // 2)
        f.write(b"\1")
    with pytest.raises(CheckpointCorruptError, match=r"extra\.hole"):
        gpumem.checkpoint.verify(tmp_path / STEP2)
    step, got, said = _restore(tmp_path)
    assert step == 1 and got == want[1]
    assert any("extra.hole" in w and "fail their CRC32C" in w for w in said)
