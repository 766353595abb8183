"""A plain restore hands the model its verified bytes in one native copy into the live storage
(issue #20): the parameters keep their storage and get the saved values exactly; tied and
non-contiguous tensors go through the model's own load_state_dict as before; a failure before
the commit leaves the model bit-identical."""

from __future__ import annotations

import pytest
import torch
from hostile_lib import snapshot
from torch import nn

import gpumem
from gpumem.checkpoint import CheckpointCorruptError
from gpumem.checkpoint.restore import plain


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # one storage behind two keys
        self.norm = nn.LayerNorm(8)
        self.register_buffer("strided", torch.arange(12.0).reshape(3, 4).t())  # not contiguous


def _objects(seed: int):
    torch.manual_seed(seed)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.head(model.norm(model.emb(torch.arange(4)))).sum().backward()
    opt.step()
    return model, opt


def test_restore_copies_into_the_live_storage_once(tmp_path, monkeypatch):
    saved_model, saved_opt = _objects(1)
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        ck.save(1, model=saved_model, optimizer=saved_opt, blocking=True)
        ck.wait()
    copies = []
    real = plain.copy_many

    def counting(srcs, dsts, threads=None):
        copies.append(len(srcs))
        return real(srcs, dsts, threads)

    monkeypatch.setattr(plain, "copy_many", counting)
    model, opt = _objects(2)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        assert ck.restore(model=model, optimizer=opt) == 1
    assert snapshot(model, opt) == snapshot(saved_model, saved_opt)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs
    assert model.head.weight is model.emb.weight
    # one native copy of the norm's weight and bias; the tied weight and the strided buffer were
    # left to load_state_dict
    assert copies == [2]


def test_a_failure_before_the_commit_leaves_the_model_bit_identical(tmp_path, monkeypatch):
    saved_model, saved_opt = _objects(1)
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        ck.save(1, model=saved_model, optimizer=saved_opt, blocking=True)
        ck.wait()
    model, opt = _objects(2)
    before = snapshot(model, opt)

    real = torch.optim.AdamW.load_state_dict
    calls = []

    def refuse_once(self, state):  # the saved state is refused, the rollback taken
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("no")
        return real(self, state)

    monkeypatch.setattr(torch.optim.AdamW, "load_state_dict", refuse_once)
    with (
        gpumem.Checkpointer(tmp_path, keep=None) as ck,
        pytest.raises(CheckpointCorruptError, match="refused"),
    ):
        ck.restore(model=model, optimizer=opt, path=tmp_path / "step-000000001")
    assert snapshot(model, opt) == before


def _storage_bytes() -> int:
    """Bytes of every distinct tensor storage Python can reach (what a leak would grow)."""
    import gc

    gc.collect()
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, nn.Parameter) and o.device.type == "cpu":
            s = o.untyped_storage()  # a DTensor has none: its local tensor is counted
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("blocking", [True, False])
def test_restore_leaves_no_second_copy_of_the_state_alive(tmp_path, blocking):
    """After restore() the Checkpointer holds neither the optimizer state the restore replaced
    (its last save's captured tensors) nor its own staged copy of the model (last_restore):
    before, both lived until the next save or restore, a second copy of the state beside the
    live one (on a GPU too), and the next save paid for freeing it (a blocking save of a 4 GiB
    state 1.5x slower)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    state_bytes = sum(p.nbytes for p in model.parameters()) * 3
    with gpumem.Checkpointer(tmp_path, keep=1) as ck:
        ck.prepare(model, opt, background=False)  # the arena restore() would prepare, sized now
        ck.save(1, model=model, optimizer=opt, blocking=blocking)
        ck.wait()
        before = _storage_bytes()
        assert ck.restore(model=model, optimizer=opt) == 1
        grown = _storage_bytes() - before
        assert grown < state_bytes / 10, f"{grown} bytes more after restore"
        assert ck.last_restore is not None  # still says what it restored
        ck.save(2, model=model, optimizer=opt, blocking=blocking)
        ck.wait()
    saved = gpumem.Checkpointer(tmp_path, keep=None)
    with saved:
        m2 = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
        assert saved.restore(model=m2) == 2
    for a, b in zip(model.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_sharded_restore_leaves_no_staged_blocks_alive(tmp_path):
    """The same for DTensor state (``ShardedRestore``), staged in fresh memory (the arena is
    capped below the state): its staged blocks and its references to the loaded tensors go
    once loaded; what it read is still reported."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = nn.Linear(1024, 1024)
        for name, p in list(model.named_parameters()):
            setattr(model, name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
        opt = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.ones_like(p)  # a DTensor like its parameter
        opt.step()
        state_bytes = sum(p.to_local().nbytes for p in model.parameters()) * 3
        with gpumem.Checkpointer(tmp_path / "ck", keep=1, staging_bytes=2 << 20) as ck:
            ck.prepare(model, opt, background=False)
            ck.save(1, model=model, optimizer=opt, blocking=True)
            ck.wait()
            before = _storage_bytes()
            assert ck.restore(model=model, optimizer=opt) == 1
            grown = _storage_bytes() - before
            assert grown < state_bytes / 10, f"{grown} bytes more after restore"
            assert ck.last_restore.bytes_read >= ck.last_restore.bytes_needed >= state_bytes
    finally:
        dist.destroy_process_group()


def _arena_range(ck) -> tuple[int, int]:
    arena = ck._staging.arena
    assert arena is not None
    t = arena.view(0, arena.nbytes)
    return t.data_ptr(), t.data_ptr() + arena.nbytes


def _all_tensors(model, opt):
    yield from model.state_dict().values()
    for st in opt.state.values():
        yield from (t for t in st.values() if isinstance(t, torch.Tensor))


def test_a_running_optimizer_keeps_its_state_tensors_and_nothing_points_into_the_arena(tmp_path):
    """A restore into objects that already hold state (a rollback, or the calibration's rounds)
    reads into the staging arena and copies into the live tensors: the optimizer keeps its
    state tensors (the same storage) with the saved values, and no tensor the objects keep lies
    in the arena the next save overwrites (tied weights and a non-contiguous buffer included)."""
    model, opt = _objects(1)
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        ck.prepare(model, opt, background=False)
        ck.save(1, model=model, optimizer=opt, blocking=True)
        ck.wait()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        saved_opt = {
            (i, k): t.clone() for i, st in opt.state_dict()["state"].items() for k, t in st.items()
        }
        ptrs = {id(t): t.data_ptr() for st in opt.state.values() for t in st.values()}
        model.head(model.norm(model.emb(torch.arange(4)))).sum().backward()
        opt.step()  # the live state moves on
        assert ck.restore(model=model, optimizer=opt) == 1
        assert {id(t): t.data_ptr() for st in opt.state.values() for t in st.values()} == ptrs
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[k]), k
        for (i, k), t in saved_opt.items():
            assert torch.equal(opt.state_dict()["state"][i][k], t), (i, k)
        lo, hi = _arena_range(ck)
        assert not [t for t in _all_tensors(model, opt) if lo <= t.data_ptr() < hi]


def test_a_state_the_optimizer_casts_on_load_gets_the_saved_values_cast(tmp_path):
    """bf16 parameters with fp32 optimizer state: torch's ``load_state_dict`` casts the state to
    the parameter's dtype (a new tensor, made before the commit copies): the commit copies the
    staged values into the tensor the optimizer holds, so the result is torch's own load's."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    for st in opt.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            st[k] = st[k].float() + 0.123  # fp32 state (not what load_state_dict keeps)
    ref = torch.optim.AdamW(nn.Linear(64, 64).to(torch.bfloat16).parameters())
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        ck.prepare(model, opt, background=False)
        ck.save(1, model=model, optimizer=opt, blocking=True)
        ck.wait()
        ref.load_state_dict(opt.state_dict())  # torch's own load of the same state
        for st in opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].zero_()
        assert ck.restore(model=model, optimizer=opt) == 1
    got, want = opt.state_dict()["state"], ref.state_dict()["state"]
    for i in want:
        for k in ("exp_avg", "exp_avg_sq"):
            assert got[i][k].dtype == want[i][k].dtype == torch.bfloat16
            assert torch.equal(got[i][k], want[i][k]), (i, k)


class _OwnLoad(torch.optim.AdamW):
    """An optimizer with its own load_state_dict (its state may not load as torch's does)."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)


def test_an_optimizer_with_its_own_loading_gets_new_state_tensors_as_before(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = _OwnLoad(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    with gpumem.Checkpointer(tmp_path, keep=None) as ck:
        ck.prepare(model, opt, background=False)
        ck.save(1, model=model, optimizer=opt, blocking=True)
        ck.wait()
        want = {
            i: {k: t.clone() for k, t in st.items()} for i, st in opt.state_dict()["state"].items()
        }
        before = {t.data_ptr() for st in opt.state.values() for t in st.values()}
        opt.step()
        assert ck.restore(model=model, optimizer=opt) == 1
        lo, hi = _arena_range(ck)
    got = opt.state_dict()["state"]
    assert all(torch.equal(got[i][k], t) for i, st in want.items() for k, t in st.items())
    after = [t.data_ptr() for st in opt.state.values() for t in st.values() if t.numel() > 1]
    assert not set(after) & before  # not copied in place: new tensors, as torch's load makes
    assert not [p for p in after if lo <= p < hi]
