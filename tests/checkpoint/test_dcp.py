"""DCP interop: ``gpumem.dcp.StorageWriter/StorageReader`` under ``dcp.save``, ``dcp.async_save``
and ``dcp.load`` with DCP's own planners (resharding included), and plain DCP directories
verified and imported without running their pickles.

One spawn of two gloo ranks (module fixture) trains an FSDP(2) model and saves its
``get_state_dict`` state three ways: ``dcp.save`` and ``dcp.async_save`` through gpumem's writer
(steps 0 and 1 of one directory) and ``dcp.save`` through DCP's ``FileSystemWriter`` (a plain DCP
directory); then both ranks load gpumem's newest back into a fresh FSDP(2) model. This process
then loads them as one plain process (DCP reshards 2 -> 1) and checks the files.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from ckpt_files import read_manifest
from sharded_lib import build, differences, full_state, train

import gpumem.dcp
from gpumem.checkpoint.capture.dtensor import sharding_supported
from gpumem.checkpoint.errors import CheckpointCorruptError
from gpumem.checkpoint.interop.dcp_plain import read_metadata, verify_plain
from gpumem.cli import main

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not sharding_supported(),
    reason="needs torch.distributed and torch >= 2.6 (public fully_shard)",
)


def _state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _set(model, opt, state) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _worker(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=rank, world_size=world)
    model, opt = build("fsdp")
    train(model, opt, 2)
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, f"{root}/ref.pt")
    dcp.save(_state(model, opt), storage_writer=gpumem.dcp.StorageWriter(f"{root}/g", keep=None))
    # its own gloo group, as DCP advises: the save's collectives run on a background thread
    # while training's run on the default group
    side = dist.new_group(backend="gloo")
    future = dcp.async_save(
        _state(model, opt), storage_writer=gpumem.dcp.StorageWriter(f"{root}/g"), process_group=side
    )
    staged = getattr(future, "staging_completion", None)  # torch versions that stage apart
    if staged is not None:
        staged.result()
        future = future.upload_completion
    train(model, opt, 1, start=2)  # training goes on while the async save writes
    future.result()
    dcp.save(_ref_state(model, opt, root), storage_writer=dcp.FileSystemWriter(f"{root}/plain"))
    fresh, fopt = build("fsdp", seed=9)
    train(fresh, fopt, 1, start=40)
    state = _state(fresh, fopt)
    dcp.load(state, storage_reader=gpumem.dcp.StorageReader(f"{root}/g"))
    _set(fresh, fopt, state)
    Path(root, f"rank{rank}.json").write_text(
        json.dumps({"diff": differences(ref, full_state(fresh, fopt))})
    )
    dist.barrier()
    dist.destroy_process_group()


def _ref_state(model, opt, root):
    """The state the plain DCP directory holds: the model as trained by now."""
    ref = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(ref, f"{root}/plain_ref.pt")
    return _state(model, opt)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    mp.spawn(_worker, args=(2, str(root)), nprocs=2, join=True)
    return root


def _load_plain(reader) -> dict:
    """dcp.load into one plain process: DCP's planner reshards the two ranks' chunks."""
    model, opt = build("plain", seed=5)
    train(model, opt, 1, start=70)
    state = _state(model, opt)
    dcp.load(state, storage_reader=reader)
    _set(model, opt, state)
    return full_state(model, opt)


def test_save_async_save_and_load_on_two_ranks(run):
    for r in range(2):
        assert json.loads((run / f"rank{r}.json").read_text())["diff"] == []
    assert sorted(p.name for p in (run / "g").glob("step-*")) == [
        "step-000000000",
        "step-000000001",
    ]
    assert json.loads((run / "g" / "latest").read_text())["path"] == "step-000000001"


def test_load_on_one_process_reshards(run):
    ref = torch.load(run / "ref.pt")
    assert differences(ref, _load_plain(gpumem.dcp.StorageReader(run / "g"))) == []
    step0 = gpumem.dcp.StorageReader(run / "g" / "step-000000000")
    assert differences(ref, _load_plain(step0)) == []


def test_metadata_is_json_and_every_chunk_is_checksummed(run, capsys):
    step = run / "g" / "step-000000001"
    assert not (step / ".metadata").exists()
    main_body = read_manifest(step / "MANIFEST")[0]
    assert main_body["dcp"]["version"] and isinstance(main_body["dcp"]["planner_data"], list)
    for r in range(2):
        body = read_manifest(step / f"manifest-r{r:05d}")[0]
        items = body["state"]["dcp"]["items"]
        assert {i["fqn"] for i in items} >= {"model.0.weight"} or r == 1
        for t in body["tensors"]:
            assert (
                len(t["crc32c"]) == max(1, -(-t["nbytes"] // body["chunk_bytes"]))
                or not t["nbytes"]
            )
    assert main(["ckpt", "verify", str(run / "g")]) == 0
    assert main(["ckpt", "ls", str(run / "g")]) == 0
    out = capsys.readouterr().out
    assert "step-000000001" in out and "<- latest" in out


def test_a_flipped_byte_fails_the_load(run, tmp_path):
    dst = tmp_path / "g"
    shutil.copytree(run / "g" / "step-000000001", dst / "step-000000001")
    data = dst / "step-000000001" / "data-r00000-0000.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    assert main(["ckpt", "verify", str(dst)]) == 1
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as caught:  # DCP wraps each rank's error
        _load_plain(gpumem.dcp.StorageReader(dst / "step-000000001"))
    error = caught.value.failures[0][0]
    assert isinstance(error, CheckpointCorruptError) and "fail their CRC32C" in str(error)


def test_plain_dcp_directory_verified_without_running_pickles(run, capsys, tmp_path):
    plain = run / "plain"
    report = verify_plain(plain)
    assert report.tensors >= 18 and report.bytes_items > 0
    assert main(["ckpt", "verify", str(plain)]) == 0
    assert "not checked" in capsys.readouterr().out

    # a hostile .metadata: a pickle that would run a command is refused by name, not run
    hostile = tmp_path / "hostile"
    shutil.copytree(plain, hostile)
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    (hostile / ".metadata").write_bytes(pickle.dumps(Boom()))
    assert main(["ckpt", "verify", str(hostile)]) == 1
    assert "posix.system is not one of DCP's metadata classes" in capsys.readouterr().out
    assert not marker.exists()

    # a tensor record whose bytes changed: its zip CRC-32 no longer matches
    bad = tmp_path / "bad"
    shutil.copytree(plain, bad)
    meta = read_metadata(bad)
    info = next(i for idx, i in meta.storage_data.items() if idx.fqn == "model.0.weight")
    file = bad / info.relative_path
    raw = bytearray(file.read_bytes())
    blob = bytes(raw[info.offset : info.offset + info.length])
    member = next(
        m for m in zipfile.ZipFile(io.BytesIO(blob)).infolist() if m.filename.endswith("data/0")
    )
    local = member.header_offset
    start = (
        local
        + 30
        + int.from_bytes(blob[local + 26 : local + 28], "little")
        + int.from_bytes(blob[local + 28 : local + 30], "little")
    )
    raw[info.offset + start + 5] ^= 0xFF  # a byte of the weight's storage
    file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=r"model\.0\.weight|CRC"):
        verify_plain(bad)


def test_import_a_plain_dcp_directory(run, tmp_path):
    out = tmp_path / "imported"
    assert main(["ckpt", "import", str(run / "plain"), str(out), "--step", "5"]) == 0
    assert main(["ckpt", "verify", str(out)]) == 0
    ref = torch.load(run / "plain_ref.pt")
    assert differences(ref, _load_plain(gpumem.dcp.StorageReader(out))) == []
    assert differences(ref, _load_plain(dcp.FileSystemReader(run / "plain"))) == []


def test_export_from_a_dcp_written_checkpoint(run, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "st"
    assert main(["ckpt", "export", str(run / "g"), "--out", str(out)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(out / f))
    ref = torch.load(run / "ref.pt")
    want = {k[len("model.") :]: v for k, v in ref.items() if k.startswith("model.")}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_symlinked_data_file_or_plain_metadata_is_refused(run, tmp_path):
    """Hostile directories (issue #14) through DCP: a data file that is a symbolic link to an
    outside copy of the very same bytes (every CRC matches) is refused by gpumem.dcp's reader,
    and a plain DCP directory whose ``.metadata`` is a link is not read through it."""
    from torch.distributed.checkpoint.api import CheckpointException

    dst = tmp_path / "g"
    shutil.copytree(run / "g" / "step-000000001", dst / "step-000000001")
    data = dst / "step-000000001" / "data-r00000-0000.bin"
    outside = tmp_path / "outside.bin"
    shutil.copyfile(data, outside)
    data.unlink()
    data.symlink_to(outside)
    with pytest.raises(CheckpointException) as caught:
        _load_plain(gpumem.dcp.StorageReader(dst / "step-000000001"))
    error = caught.value.failures[0][0]
    assert isinstance(error, CheckpointCorruptError) and "symbolic link" in str(error)
    assert main(["ckpt", "verify", str(dst)]) == 1

    plain = tmp_path / "plain"
    shutil.copytree(run / "plain", plain)
    meta = plain / ".metadata"
    shutil.copyfile(meta, tmp_path / "outside.metadata")
    meta.unlink()
    meta.symlink_to(tmp_path / "outside.metadata")
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        read_metadata(plain)


class _Command:
    """Pickles as a call of os.system: what a hostile DCP byte item holds."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_byte_items_that_load_classes_are_named_and_not_imported_untrusted(tmp_path, capsys):
    """Issue #25, finding 5: a plain DCP directory whose byte item is a pickle that loads a class
    (here os.system) passes every structural check; ``dcp.load`` through gpumem's reader would
    unpickle it after import. verify names it, import refuses it and writes nothing unless
    --trust-pickle; plain-data byte items (a learning rate) still import."""
    from gpumem.checkpoint.interop.dcp_plain import PickledItemsError, import_plain

    marker = tmp_path / "pwned"
    plain = tmp_path / "plain"
    state = {"w": torch.arange(4.0), "lr": 0.5, "hook": _Command(marker)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(plain), no_dist=True)
    report = verify_plain(plain)
    assert report.bytes_items == 2 and report.pickled == {"hook": "posix.system"}
    assert main(["ckpt", "verify", str(plain)]) == 0
    out = capsys.readouterr().out
    assert "WARNING  1 byte item(s) ('hook' loads posix.system)" in out
    dest = tmp_path / "imported"
    assert main(["ckpt", "import", str(plain), str(dest)]) == 2
    err = capsys.readouterr()
    said = err.out + err.err
    assert "'hook' loads posix.system" in said and "--trust-pickle" in said
    assert not dest.exists() or not any(dest.iterdir())
    with pytest.raises(PickledItemsError, match="nothing was imported"):
        import_plain(plain, dest)
    assert not marker.exists()
    # the same directory without the hostile item imports, its learning rate carried
    dcp.save(
        {"w": torch.arange(4.0), "lr": 0.5},
        storage_writer=dcp.FileSystemWriter(tmp_path / "benign"),
        no_dist=True,
    )
    assert main(["ckpt", "import", str(tmp_path / "benign"), str(dest)]) == 0
    loaded = {"w": torch.zeros(4), "lr": 0.0}
    dcp.load(loaded, storage_reader=gpumem.dcp.StorageReader(dest), no_dist=True)
    assert loaded["lr"] == 0.5 and torch.equal(loaded["w"], torch.arange(4.0))
    # trusted: imported as asked
    assert main(["ckpt", "import", str(plain), str(tmp_path / "trusted"), "--trust-pickle"]) == 0
    assert not marker.exists()
