"""Trainer integrations with the real libraries, under DDP with gloo on CPU (two ranks each):
``gpumem.integrations.hf.CheckpointCallback`` in the transformers Trainer and
``gpumem.integrations.lightning.CheckpointCallback`` in Lightning.

Per library, two launches of two processes (``hf_train.py`` / ``lightning_train.py``): an
uninterrupted run to 8 steps (the reference; the model has dropout 0.1, the sampler shuffles and
the stop falls mid-epoch) followed, in the same processes, by a run to 8 in
which rank 0 gets SIGTERM after step 3 (the guard saves at the next step boundary, step 4,
durable, and both ranks exit 143); then a run in the same directory that resumes and finishes.
The resumed run's final weights equal the uninterrupted run's bit for bit: model, optimizer,
scheduler, RNG and the trainer's own position (HF's TrainerState, Lightning's fit loop) came
back, and the trainer skipped what was done. FSDP variants need a GPU in these libraries
(tests under the ``gpu`` marker in test_gpu_sharded.py).

The docs' loader table is checked cell by cell (``lightning_loaders.py``): five loaders on one
device and on 2 DDP ranks, stopped in epoch 0, at its end and in epoch 1, each resumed and
compared with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def _launch(script: str, root: Path, tag: str, *argv: str) -> list[tuple[int, str]]:
    tmp = root / "tmp"  # the ranks' TMPDIR: what a resume leaves behind is seen here
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, WORLD_SIZE="2", INIT=f"file://{root}/rdzv-{tag}", OMP_NUM_THREADS="1")
    env["TMPDIR"] = str(tmp)
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / script), *argv],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    return [(p.wait(timeout=300), p.stdout.read()) for p in procs]


def _run(script: str, root: Path) -> dict:
    ck = root / "ck"
    # the uninterrupted reference run first, in the same two processes as the stopped one
    straight = ["--straight", str(root / "ck2"), str(root / "straight.json"), "8"]
    stopped = _launch(script, root, "stopped", *straight, str(ck), str(root / "x.json"), "8", "3")
    for rc, log in stopped:
        assert rc == 143, log[-3000:]
    assert "SIGTERM -> stopping at step 4: " in stopped[0][1]
    assert "a stop request on another rank -> stopping at step 4" in stopped[1][1]
    assert json.loads((ck / "latest").read_text())["step"] == 4
    for rc, log in _launch(script, root, "resumed", str(ck), str(root / "resumed.json"), "8"):
        assert rc == 0, log[-3000:]
    assert not list((root / "tmp").glob("gpumem-*")), "a resume left temporary files behind"
    resumed = json.loads((root / "resumed.json").read_text())
    straight = json.loads((root / "straight.json").read_text())
    assert resumed["step"] == straight["step"] == 8
    assert resumed["weights"] == straight["weights"]
    return resumed


def test_transformers_trainer_resumes_bit_exact_after_sigterm(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    resumed = _run("hf_train.py", tmp_path)
    assert resumed["resumed"] is True


def test_lightning_trainer_resumes_bit_exact_after_sigterm(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("torchdata.stateful_dataloader")
    resumed = _run("lightning_train.py", tmp_path)
    assert resumed["restored"] == 4
    # the same batches (a StatefulDataLoader's position restored) and the same losses (dropout)
    straight = json.loads((tmp_path / "straight.json").read_text())
    assert resumed["trace"] == straight["trace"][4:]


# the docs' loader table (docs/checkpoint.md): its rows by the loader lightning_loaders.py builds
LOADER_ROWS = {
    "stateful-sampler": "StatefulDataLoader(ds, sampler=RandomSampler(ds))",
    "stateful-ordered": "StatefulDataLoader(ds, shuffle=False)",
    "stateful-shuffle": "StatefulDataLoader(ds, shuffle=True)",
    "plain-shuffle": "DataLoader(ds, shuffle=True)",
    "plain-ordered": "DataLoader(ds, shuffle=False)",
}
STOPS = ("epoch 0", "epoch end", "epoch 1")  # its columns, on one device and then on 2 ranks


def _loader_table() -> dict[str, list[bool]]:
    """Per loader, whether each of the table's six cells says "exact"."""
    rows = {}
    for line in (HERE.parent.parent / "docs" / "checkpoint.md").read_text().splitlines():
        for kind, code in LOADER_ROWS.items():
            if line.startswith(f"| `{code}` |"):
                rows[kind] = [c.strip().startswith("exact") for c in line.split("|")[2:-1]]
    return rows


def test_lightning_resumes_exactly_where_the_docs_loader_table_says(tmp_path):
    """Issue 43 (1): each loader of the table on one device and on 2 DDP ranks, stopped in epoch
    0, at its end and in epoch 1, resumed to the uninterrupted run's steps (each batch and loss,
    dropout 0.1) and final weights exactly where the table says "exact", and not elsewhere.
    Before the fix, one device with torch's RandomSampler was exact nowhere (the interrupted
    epoch's order was drawn from the RNG states of the stop), nor any StatefulDataLoader
    stopped at an epoch's end."""
    pytest.importorskip("lightning")
    pytest.importorskip("torchdata.stateful_dataloader")
    table = _loader_table()
    assert sorted(table) == sorted(LOADER_ROWS) and {len(r) for r in table.values()} == {6}
    one = tmp_path / "one"
    one.mkdir()
    env = dict(os.environ, WORLD_SIZE="1", OMP_NUM_THREADS="1")
    argv = [sys.executable, str(HERE / "lightning_loaders.py"), str(one), str(one / "r.json")]
    done = subprocess.run(
        [*argv, *LOADER_ROWS], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    two = tmp_path / "two"
    two.mkdir()
    for rc, log in _launch(
        "lightning_loaders.py", two, "loaders", str(two), str(two / "r.json"), *LOADER_ROWS
    ):
        assert rc == 0, log[-3000:]
    results = [json.loads((d / "r.json").read_text()) for d in (one, two)]
    measured, detail = {}, {}
    for kind in LOADER_ROWS:
        cells = [r[f"{kind}/{stop}"] for r in results for stop in STOPS]
        # every resumed run ran only the steps left, whatever its batches
        assert all(c["steps_run"] == c["steps_left"] for c in cells), (kind, cells)
        measured[kind] = [c["exact"] for c in cells]
        detail[kind] = [c["tensors_equal"] for c in cells]
    assert measured == table, f"tensors equal per cell: {detail}"


def _tiny_trainer(tmp_path, cb, **args):
    from torch import nn
    from transformers import Trainer, TrainingArguments

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x, labels=None):
            return {"loss": nn.functional.mse_loss(self.lin(x), labels)}

    x = torch.arange(16.0).reshape(8, 2)
    data = [{"x": x[i], "labels": x[i].sum(0, keepdim=True)} for i in range(8)]
    kw = {"output_dir": str(tmp_path / "hf"), "use_cpu": True, "report_to": []}
    return Trainer(
        model=Tiny(),
        args=TrainingArguments(**{**kw, **args}),
        train_dataset=data,
        callbacks=[cb],
    )


def test_docs_and_examples_call_the_hf_callback_with_the_new_interval_name():
    """README, docs, docstrings, tests and benchmarks pass ``every_n_train_steps=`` to
    ``CheckpointCallback``, never the deprecated ``save_steps=`` (but where that is tested)."""
    import re

    repo = HERE.parent.parent
    files = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    for part in ("gpumem", "tests", "benchmarks"):
        files += sorted((repo / part).rglob("*.py"))
    call = re.compile(r"CheckpointCallback\([^)]*\bsave_steps\s*=\s*\w")  # not "=..."
    found = [
        f"{f.relative_to(repo)}:{i}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines(), start=1)
        if call.search(line) and "deprecated name, on purpose" not in line
    ]
    assert not found, f"CheckpointCallback(save_steps=...) in {found}: use every_n_train_steps="


def test_hf_callback_interval_is_named_as_in_lightning_and_save_strategy_is_checked(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from gpumem.integrations.hf import CheckpointCallback

    with pytest.warns(DeprecationWarning, match="every_n_train_steps"):
        old = CheckpointCallback(tmp_path / "a", save_steps=3)  # the deprecated name, on purpose
    assert old.every == 3
    cb = CheckpointCallback(tmp_path / "b", every_n_train_steps=1)
    trainer = _tiny_trainer(tmp_path, cb, max_steps=1)  # the default save_strategy: "steps"
    with pytest.warns(UserWarning, match='save_strategy="no"'):
        trainer.train(resume_from_checkpoint=cb.resume_from(trainer))
    cb.close()
    again = CheckpointCallback(tmp_path / "b", every_n_train_steps=1)
    trainer = _tiny_trainer(tmp_path, again, max_steps=2, save_strategy="no")
    stub = again.resume_from(trainer)
    assert stub is not None and Path(stub).is_dir()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*save_strategy")
        trainer.train(resume_from_checkpoint=stub)  # resumes at step 1
    again.close()
    assert trainer.state.global_step == 2
    assert not Path(stub).exists()  # the stub is gone once the Trainer read it


def _arena_at_first_save(monkeypatch) -> list[bool]:
    """Whether the staging arena existed when each save() began (spying on the Checkpointer)."""
    from gpumem.checkpoint import Checkpointer

    seen: list[bool] = []
    real = Checkpointer.save

    def spy(self, *args, **kwargs):
        seen.append(self._staging.allocated)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", spy)
    return seen


def test_hf_fresh_run_prepares_the_first_saves_arena(tmp_path, monkeypatch):
    """Nothing to resume: the callback still prepares the arena (after the optimizer's first
    step, which makes AdamW's state), so the first periodic save does not allocate it."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from gpumem.integrations.hf import CheckpointCallback

    seen = _arena_at_first_save(monkeypatch)
    cb = CheckpointCallback(tmp_path / "ck", every_n_train_steps=1)
    trainer = _tiny_trainer(tmp_path, cb, max_steps=2, save_strategy="no")
    assert cb.resume_from(trainer) is None
    trainer.train()
    cb.close()
    assert seen == [True, True]


@pytest.mark.parametrize("resume", [False, True])
def test_lightning_fresh_run_prepares_the_first_saves_arena(tmp_path, monkeypatch, resume):
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from torch import nn

    from gpumem.integrations.lightning import CheckpointCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    seen = _arena_at_first_save(monkeypatch)
    cb = CheckpointCallback(tmp_path / "ck", every_n_train_steps=1, resume=resume)
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=4))
    assert seen == [True, True]
