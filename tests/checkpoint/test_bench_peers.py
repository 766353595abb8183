"""benchmarks/checkpoint_peers.py: every peer adapter's save and restore round-trip a small model
and AdamW state bit for bit, while the state changes under a background write (behaviour only; the
timings are the benchmark's). A peer whose package is not installed is skipped."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _peers_module():
    sys.path.insert(0, str(BENCH))  # checkpoint_peers imports its sibling _report
    try:
        spec = importlib.util.spec_from_file_location(
            "checkpoint_peers", BENCH / "checkpoint_peers.py"
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


peers = _peers_module()


def _state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return model, opt


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = _state(0)
    for _ in range(3):
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            out[f"optim.{i}.{k}"] = torch.as_tensor(v)
    return out


@pytest.mark.parametrize("key", list(peers.PEERS))
def test_peer_restore_is_bit_identical(key: str, tmp_path: Path) -> None:
    peer = peers.PEERS[key]()
    reason = peer.unavailable()
    if reason:
        pytest.skip(reason)
    model, opt = _trained()
    expected = {k: v.clone() for k, v in _flat(model, opt).items()}
    path = tmp_path / key
    peer.open(model, opt, path)
    try:
        wait = peer.begin(model, opt, path)
        # the saved bytes are the state at the save call: the loop changing the state while the
        # peer writes in the background must not reach them
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            for s in opt.state.values():
                s["exp_avg"].mul_(2.0)
        wait()
        peers.fsync_tree(path)
    finally:
        peer.close()

    fresh, fresh_opt = _state(1)  # other values, and no optimizer state yet: a resuming job
    assert not fresh_opt.state
    peers.PEERS[key]().restore(path, fresh, fresh_opt)
    got = _flat(fresh, fresh_opt)
    assert got.keys() == expected.keys()
    for k, want in expected.items():
        assert got[k].dtype == want.dtype, k
        assert torch.equal(got[k], want), k
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_fsync_tree_walks_files_and_dirs(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"x")
    (tmp_path / "g").write_bytes(b"y")
    peers.fsync_tree(tmp_path / "a")
    peers.fsync_tree(tmp_path / "g")
    with pytest.raises(FileNotFoundError):
        peers.fsync_tree(tmp_path / "missing")
