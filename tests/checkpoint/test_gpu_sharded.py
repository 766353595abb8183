"""Sharded checkpoints on a GPU (``gpu`` marker): FSDP2 with NCCL at world size 1 and DTensor
state with gloo over CUDA tensors save and restore bit-exact with device-side CRC32C (the
snapshot checksums the CUDA blocks with the Triton kernel; ``verify_loaded`` checks them again
where they land), in overlap mode; and the trainer integrations' FSDP variants, which these
libraries run only on a GPU. Each case runs in a child process of its own (a process group per
case).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gpumem
from gpumem.checkpoint.capture.dtensor import sharding_supported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not dist.is_available() or not sharding_supported(),
        reason="needs torch.distributed and torch >= 2.6",
    ),
]


def _nccl_fsdp(rank: int, root: str) -> None:
    from sharded_lib import build, differences, full_state, train

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{root}/rdzv-nccl", rank=0, world_size=1)
    model, opt = build("fsdp", device="cuda")
    train(model, opt, 2, device="cuda")
    ref = full_state(model, opt)
    torch.save(ref, f"{root}/ref.pt")
    with gpumem.Checkpointer(f"{root}/nccl", chunk_bytes=4096) as ck:
        stats = ck.save(2, model=model, optimizer=opt)  # overlap: copied while the step waits
        train(model, opt, 1, start=2, device="cuda")
        ck.wait()
    fresh, fopt = build("fsdp", seed=9, device="cuda")
    train(fresh, fopt, 1, start=40, device="cuda")
    with gpumem.Checkpointer(f"{root}/nccl") as ck:
        step = ck.restore(model=fresh, optimizer=fopt, verify_loaded=True)
    out = {"mode": stats.mode, "step": step, "diff": differences(ref, full_state(fresh, fopt))}
    Path(root, "nccl.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_fsdp2_nccl_world_one_round_trip(tmp_path):
    from sharded_lib import build, differences, full_state

    mp.spawn(_nccl_fsdp, args=(str(tmp_path),), nprocs=1, join=True)
    out = json.loads((tmp_path / "nccl.json").read_text())
    assert out == {"mode": "overlap", "step": 2, "diff": []}
    # the GPU-written sharded checkpoint into a plain model on the host
    model, opt = build("plain", seed=5)
    with gpumem.Checkpointer(tmp_path / "nccl") as ck:
        assert ck.restore(model=model, optimizer=opt) == 2
    assert differences(torch.load(tmp_path / "ref.pt"), full_state(model, opt)) == []


def _gloo_cuda(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.cuda.set_device(0)
    dist.init_process_group(
        "cpu:gloo,cuda:gloo", init_method=f"file://{root}/rdzv-gloo", rank=0, world_size=1
    )
    mesh = init_device_mesh("cuda", (1,))
    g = torch.Generator(device="cuda").manual_seed(0)
    w = distribute_tensor(torch.randn(300, 70, device="cuda", generator=g), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(70, device="cuda", generator=g), mesh, [Replicate()])
    with gpumem.Checkpointer(f"{root}/gloo", chunk_bytes=4096) as ck:
        ck.save(1, extra={"w": w, "b": b}, rng=False)
    got: dict = {}
    with gpumem.Checkpointer(f"{root}/gloo") as ck:
        ck.restore(extra=got, rng=False)
    same = torch.equal(got["w"], w.full_tensor().cpu()) and torch.equal(
        got["b"], b.full_tensor().cpu()
    )
    Path(root, "gloo.json").write_text(json.dumps({"same": bool(same)}))
    dist.destroy_process_group()


def test_dtensor_gloo_with_cuda_tensors(tmp_path):
    mp.spawn(_gloo_cuda, args=(str(tmp_path),), nprocs=1, join=True)
    assert json.loads((tmp_path / "gloo.json").read_text()) == {"same": True}
    assert gpumem.checkpoint.verify(tmp_path / "gloo" / "step-000000001").sharded


_HF_FSDP = """
import json, os, sys, torch, torch.distributed as dist
from torch import nn
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="1")
dist.init_process_group("nccl", init_method=sys.argv[3], rank=0, world_size=1)
from transformers import Trainer, TrainingArguments
from gpumem.integrations.hf import CheckpointCallback

class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

g = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=g)
data = [{"x": x[i], "labels": x[i].sum(0, keepdim=True)} for i in range(64)]
args = TrainingArguments(output_dir=sys.argv[1] + "/hf", per_device_train_batch_size=4,
                         max_steps=int(sys.argv[2]), learning_rate=0.05, save_strategy="no",
                         report_to=[], logging_strategy="no", seed=0, disable_tqdm=True,
                         fsdp="full_shard", fsdp_config={"fsdp_version": 2})
cb = CheckpointCallback(sys.argv[1], every_n_train_steps=2)
trainer = Trainer(model=Regressor(), args=args, train_dataset=data, callbacks=[cb])
trainer.train(resume_from_checkpoint=cb.resume_from(trainer))
cb.close()
sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu().flatten().tolist()
      for k, v in trainer.model.state_dict().items()}
print("RESULT", json.dumps({"step": trainer.state.global_step, "weights": sd}))
dist.destroy_process_group()
"""


def _hf(tmp_path: Path, ckdir: Path, steps: int, tag: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _HF_FSDP, str(ckdir), str(steps), f"file://{tmp_path}/rdzv-{tag}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_hf_trainer_fsdp2_resumes(tmp_path):
    """transformers' Trainer with FSDP2 (accelerate refuses FSDP without a GPU): 4 steps, then
    a new process resumes to 8; equal to a straight run to 8."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _hf(tmp_path, tmp_path / "ck", 4, "a")
    resumed = _hf(tmp_path, tmp_path / "ck", 8, "b")
    straight = _hf(tmp_path, tmp_path / "ck2", 8, "c")
    assert resumed["step"] == straight["step"] == 8
    assert resumed["weights"] == straight["weights"]


_LIGHTNING_FSDP = """
import json, os, sys, torch, torch.distributed as dist
from torch import nn
import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from gpumem.integrations.lightning import CheckpointCallback

class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g)
        ds = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
        return torch.utils.data.DataLoader(ds, batch_size=4)

pl.seed_everything(0)
cb = CheckpointCallback(sys.argv[1], every_n_train_steps=2)
trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=ModelParallelStrategy(),
                     max_steps=int(sys.argv[2]), callbacks=[cb], enable_checkpointing=False,
                     logger=False, enable_progress_bar=False, enable_model_summary=False)
model = Regressor()
trainer.fit(model)
sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu().flatten().tolist()
      for k, v in model.state_dict().items()}
print("RESULT", json.dumps({"step": trainer.global_step, "restored": cb.restored_step,
                            "weights": sd}))
"""


def _lightning(ckdir: Path, steps: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _LIGHTNING_FSDP, str(ckdir), str(steps)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_lightning_fsdp2_resumes(tmp_path):
    """Lightning's ModelParallelStrategy (FSDP2 in configure_model; a GPU strategy): 4 steps,
    then a new process resumes to 8; equal to a straight run to 8."""
    pytest.importorskip("lightning")
    _lightning(tmp_path / "ck", 4)
    resumed = _lightning(tmp_path / "ck", 8)
    straight = _lightning(tmp_path / "ck2", 8)
    assert resumed["restored"] == 4 and resumed["step"] == straight["step"] == 8
    assert resumed["weights"] == straight["weights"]
