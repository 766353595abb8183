"""CUDA paths: device-side CRC before the D2H copy, side-stream overlap, pinned staging."""

import pytest
import torch

import gpumem

pytestmark = pytest.mark.gpu


# staging budget -> the mode save() must pick for _setup's state (~830 KiB with AdamW state):
# None fits (overlap); 256 KiB streams through two 128 KiB slots, splitting the 256 KiB weight.
# tests/checkpoint/test_cuda_cpu.py checks these on CPU tensors of the same sizes.
BUDGET_MODES = {None: "overlap", 1 << 18: "streaming"}
CHUNK = 65536


def _setup(seed, device="cuda"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _train(model, opt, steps, x):
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("budget", list(BUDGET_MODES))
def test_cuda_round_trip_overlap_and_streaming(tmp_path, budget):
    x = torch.randn(64, 256, device="cuda")
    model, opt = _setup(0)
    _train(model, opt, 3, x)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = {i: s["exp_avg"].clone() for i, s in opt.state_dict()["state"].items()}
    with gpumem.Checkpointer(tmp_path, staging_bytes=budget, chunk_bytes=CHUNK) as ck:
        stats = ck.save(3, model=model, optimizer=opt)
        assert stats.mode == BUDGET_MODES[budget]
        _train(model, opt, 2, x)  # mutates parameters right after save(): the hook must fence it
        ck.wait()
        model2, opt2 = _setup(1)
        assert ck.restore(model=model2, optimizer=opt2) == 3
    for k, v in model2.state_dict().items():
        assert v.device.type == "cuda" and torch.equal(v, expected[k]), k
    for i, s in opt2.state_dict()["state"].items():
        assert torch.equal(s["exp_avg"], exp_avg[i])


def test_cuda_rng_states_round_trip(tmp_path):
    torch.cuda.manual_seed_all(5)
    with gpumem.Checkpointer(tmp_path) as ck:
        ck.save(1, extra={"t": torch.arange(10, device="cuda")})
        want = torch.rand(4, device="cuda")
        ck.wait()
        torch.cuda.manual_seed_all(6)
        got: dict = {}
        ck.restore(extra=got)
    assert torch.equal(torch.rand(4, device="cuda"), want)
    assert torch.equal(got["t"], torch.arange(10))


def test_cuda_restore_verifies_the_loaded_bytes_on_the_device(tmp_path, monkeypatch):
    """verify_loaded re-checks the state after the host-to-device copy with the Triton kernel:
    a clean restore passes, a byte damaged on the device is named."""
    from gpumem.checkpoint import CheckpointCorruptError
    from gpumem.checkpoint.restore import plain as state_mod

    x = torch.randn(64, 256, device="cuda")
    model, opt = _setup(0)
    _train(model, opt, 2, x)
    with gpumem.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ck:
        ck.save(2, model=model, optimizer=opt)
        ck.wait()
        model2, opt2 = _setup(1)
        assert ck.restore(model=model2, optimizer=opt2, verify_loaded=True) == 2
        real_apply = state_mod.apply

        def damaging_apply(tree, state, **kw):
            real_apply(tree, state, **kw)
            with torch.no_grad():
                state.model[2].weight.view(-1)[5] += 1.0

        monkeypatch.setattr(state_mod, "apply", damaging_apply)
        with pytest.raises(CheckpointCorruptError, match=r"model\.2\.weight' on cuda"):
            ck.restore(model=model2, optimizer=opt2, verify_loaded=True)


def test_device_crcs_match_the_native_crcs():
    """The batched device CRCs (one buffer, one launch for the word-aligned tensors and one for
    the rest, one copy to pinned memory): raw int32 bits per chunk, equal to the native CRC32C
    of the same bytes."""
    from gpumem.checkpoint.stage.device_copy import device_crcs
    from gpumem.checksum import chunk_crc32c

    g = torch.Generator().manual_seed(3)
    sizes = (0, 1, 255, 4096, 70_001, 70_004, 3 << 20, (3 << 20) + 12)
    hosts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    on_gpu = [h.cuda() for h in hosts]
    for _ in range(2):  # the second time, the program tables come from their cache
        got = device_crcs(on_gpu, CHUNK)
        torch.cuda.current_stream().synchronize()
        for h, crc in zip(hosts, got, strict=True):
            assert crc.device.type == "cpu" and crc.dtype == torch.int32
            assert [x & 0xFFFFFFFF for x in crc.tolist()] == chunk_crc32c(h, CHUNK).tolist()


def test_one_native_enqueue_and_one_crc_launch_per_save(tmp_path, monkeypatch):
    """A bf16 model with odd-sized tensors: every contiguous piece's copy is in the one native
    enqueue (one cudaMemcpyAsync per piece: none crosses a 1 GiB chunk here), the CRCs take at
    most two launches (word-aligned and not), and the checkpoint verifies and restores bit for
    bit."""
    import gpumem.kernels.crc32c as K
    from gpumem.checkpoint import verify

    launches = []
    real = K.launch_many
    monkeypatch.setattr(
        K, "launch_many", lambda p, b, o: launches.append(len(p.launches)) or real(p, b, o)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 77), torch.nn.Linear(77, 3)).cuda().bfloat16()
    with gpumem.Checkpointer(tmp_path, chunk_bytes=CHUNK, overlap=False) as ck:
        stats = ck.save(1, model=model)
        ck.wait()
        snap = ck._job.snapshot.copy_event
        assert snap.calls == 4  # two weights, two biases: one cudaMemcpyAsync each, one call
        assert launches == [2]  # 300*77*2 bytes is a multiple of 4; 77*2, 77*3*2, 3*2 are not
        assert stats.copy_device_s > 0 and stats.crc_device_s > 0
    verify(tmp_path / "step-000000001")
    fresh = torch.nn.Sequential(torch.nn.Linear(300, 77), torch.nn.Linear(77, 3)).cuda().bfloat16()
    with gpumem.Checkpointer(tmp_path, read_only=True) as ck:
        assert ck.restore(model=fresh) == 1
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spill", [64 << 20, 1 << 30])
def test_the_device_spill_keeps_the_step_behind_the_copy(tmp_path, spill):
    """Sixteen 64 MiB parameters, optimizer.step() right after save(): the fence stops the
    copier, spills what fits the buffer (64 MiB: at most one parameter; 1 GiB: all that is
    left), waits for the rest, and the restored values are the pre-step ones either way."""
    model = torch.nn.Module()
    model.ps = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(16 << 20, device="cuda")) for _ in range(16)]
    )
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    with gpumem.Checkpointer(tmp_path, chunk_bytes=4 << 20, device_spill_bytes=spill) as ck:
        ck.prepare(nbytes=(1 << 30) + (64 << 20), background=False)
        st = ck.save(1, model=model, optimizer=opt, rng=False)
        assert st.mode == "overlap"
        opt.step()  # p -= 1: behind the fence (spill or D2H)
        ck.wait()
        assert st.spill_bytes % (64 << 20) == 0 and st.spill_bytes <= spill
        for p, b in zip(model.parameters(), before, strict=True):
            assert torch.equal(p, b - 1)
        model2 = torch.nn.Module()
        model2.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros_like(b)) for b in before]
        )
        assert ck.restore(model=model2, optimizer=torch.optim.SGD(model2.parameters())) == 1
    for p, b in zip(model2.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_overlap_fence_keeps_the_step_behind_a_long_copy(tmp_path):
    """A 512 MiB parameter takes ~10 ms to copy out; optimizer.step() right after save() must
    still not change it before the copy and its CRCs have read it. The pre-step hook fences the
    optimizer's stream (its kernels queue behind the copy) instead of blocking the host: the
    restored values are the pre-step ones."""
    model = torch.nn.Module()
    model.p = torch.nn.Parameter(torch.randn(128 << 20, device="cuda"))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model.p.grad = torch.ones_like(model.p)
    before = model.p.detach().clone()
    with gpumem.Checkpointer(tmp_path, chunk_bytes=4 << 20) as ck:
        ck.prepare(nbytes=(512 << 20) + (64 << 20), background=False)
        assert ck.save(1, model=model, optimizer=opt, rng=False).mode == "overlap"
        opt.step()  # p -= 1, enqueued behind the fence
        ck.wait()
        assert torch.equal(model.p, before - 1)
        model2 = torch.nn.Module()
        model2.p = torch.nn.Parameter(torch.zeros_like(before))
        assert ck.restore(model=model2, optimizer=torch.optim.SGD(model2.parameters(), lr=1.0)) == 1
    assert torch.equal(model2.p, before)
