"""Every command line is untrusted: a generated sweep of bad argument vectors over every
subcommand. Each must end with exit code 2, exactly one line on stderr naming the command, no
traceback, nothing on stdout (it was refused before any work), and nothing written.

The vectors are a table: for each subcommand a valid base command, and for each of its options
the bad values of that option's kind (counts, sizes, seconds, paths, choices, names); plus
unknown options, missing operands, and the cases issue #13 found by hand.
"""

from __future__ import annotations

import pytest

from gpumem.cli import main

BAD_INT = ["-1", "x", "1.5", "1e3", ""]
BAD_POS_INT = [*BAD_INT, "0"]
BAD_FLOAT = ["-1", "nan", "inf", "x", ""]
BAD_POS_FLOAT = [*BAD_FLOAT, "0"]
BAD_SIZE = ["lots", "0", "-5MiB", "3XB", ""]
BAD_CHOICE = ["bogus", ""]
MISSING = "/nonexistent/gpumem-test/x"

# subcommand -> (valid base argv, {option: bad values})
SPECS: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "doctor": (
        ["doctor"],
        {"--size": [*BAD_SIZE, "100TiB"], "--dir": [MISSING]},
    ),
    "profile": (
        ["profile", "gpt2"],
        {
            "--batch-size": BAD_POS_INT,
            "--seq-len": BAD_POS_INT,
            "--steps": [*BAD_POS_INT, "100000"],
            "--depth": BAD_INT,
            "--optimizer": BAD_CHOICE,
            "--precision": [*BAD_CHOICE, "int4"],
            "--device": [*BAD_CHOICE, "tpu"],
            "--mode": BAD_CHOICE,
            "--plot": [f"{MISSING}.png", "chart.pdf", "-"],
            "--json": [f"{MISSING}.json"],
            "--trace": [f"{MISSING}.json"],
            "--memory-snapshot": [f"{MISSING}.pickle"],
            "--size": ["1b", "huge", ""],
        },
    ),
    "estimate": (
        ["estimate", "gpt2"],
        {
            "--batch-size": BAD_POS_INT,
            "--seq-len": [*BAD_POS_INT, "4096"],  # gpt2 has 1024 learned positions
            "--grad-accum": BAD_POS_INT,
            "--gpus": [*BAD_POS_INT, "99999999"],
            "--tp": BAD_POS_INT,
            "--pp": BAD_POS_INT,
            "--dp": BAD_POS_INT,
            "--vpp": BAD_POS_INT,
            "--zero": ["4", "-1", "x"],
            "--fsdp": BAD_CHOICE,
            "--gpu": ["H1000", ""],
            "--gpu-memory": BAD_SIZE,
            "--precision": ["fp8-magic", ""],
            "--optimizer": ["lion9", ""],
            "--recompute": ["sometimes"],
            "--attention": ["quantum"],
            "--lora-rank": ["-1", "x"],
            "--calibration": [MISSING],
            "--plot": [f"{MISSING}.png", "bill.svg"],
            "--activation-model": BAD_CHOICE,
        },
    ),
    "plan": (
        ["plan", "gpt2", "--gpus", "8"],
        {
            "--gpus": [*BAD_POS_INT, "99999999"],
            "--seq-len": BAD_POS_INT,
            "--global-batch": BAD_POS_INT,
            "--top": BAD_POS_INT,
            "--mtbf-hours": BAD_POS_FLOAT,
            "--preemption-rate": BAD_POS_FLOAT,
            "--price-per-gpu-hour": BAD_POS_FLOAT,
            "--stall-s": BAD_FLOAT,
            "--persist-s": BAD_FLOAT,
            "--restart-s": BAD_FLOAT,
            "--startup-s": BAD_FLOAT,
            "--run-hours": BAD_POS_FLOAT,
            "--preempted-at-hours": BAD_FLOAT,
            "--gpu": ["H1000"],
            "--calibration": [MISSING],
            "--capacity": [
                "",
                "spot",
                "cloud,price=1",
                "on-demand",
                "on-demand,price=-1",
                "on-demand,price=x",
                "spot,price=1,notice=0",
                "spot,price=1,notice=slow",
                "spot,price=1,availability=0.5",
                "spot,price=1,availability=2,outage-h=1",
                f"spot,price=1,trace={MISSING}.json",
                "on-demand,price=1,bogus=2",
                "on-demand,price=1,price=2",
            ],
            "--deadline": ["0", "-5h", "x", "inf", ""],
            "--slurm": [f"{MISSING}/job.sbatch", "gpt2"],
            "--k8s": [f"{MISSING}/job.yaml", "gpt2"],
            "--skypilot": [f"{MISSING}/task.yaml", "llama-2-7b"],
            "--confidence": ["0", "1", "1.5", "x"],
        },
    ),
    "calibrate": (
        ["calibrate", "--device", "cpu"],
        {
            "--sizes": [*BAD_SIZE, "1MiB", "1MiB,100TiB", ","],
            "--repeat": [*BAD_POS_INT, "5000"],
            "--dir": [MISSING],
            "--out": [f"{MISSING}.json"],
            "--report": [MISSING],
            "--device": ["tpu"],
        },
    ),
    "demo": (["demo", "--quick"], {"--out": [f"{MISSING}/demo"]}),
    "ckpt ls": (["ckpt", "ls", "."], {}),
    "ckpt inspect": (["ckpt", "inspect", "."], {"--limit": BAD_INT}),
}

# operands and whole command lines that are wrong as such
EXTRA: list[list[str]] = [
    ["nosuchcommand"],
    ["profile"],
    ["estimate"],
    ["plan"],
    ["ckpt"],
    ["ckpt", "nosuchaction", "."],
    ["ckpt", "ls", MISSING],
    ["ckpt", "verify", MISSING],
    ["ckpt", "inspect", MISSING],
    ["profile", "nosuchmodel"],
    ["profile", f"{MISSING}.json"],
    ["estimate", "lama-2-70b"],
    ["estimate", f"{MISSING}/config.json"],
    ["plan", "nosuchmodel", "--gpus", "8"],
    ["estimate", "llama-2-7b", "--gpus", "8", "--tp", "3"],
    ["estimate", "gpt2", "--sp"],
    ["estimate", "gpt2", "--qlora"],
    ["plan", "gpt2", "--mtbf-hours", "5", "--preemption-rate", "0.1"],
    ["plan", "gpt2", "--stall-s", "10", "--persist-s", "1", "--mtbf-hours", "5"],
    ["plan", "gpt2", "--startup-s", "10", "--mtbf-hours", "5"],
    ["estimate", "gpt2", "--json", "--markdown"],
    ["plan", "gpt2", "--slurm", "--k8s"],
    ["plan", "gpt2", "--slurm"],  # the FILE is required (- for stdout)
    ["plan", "--slurm", "gpt2"],  # the model where the FILE goes
    ["plan", "gpt2", "--k8s", "-", "--skypilot", "-"],
    # issue #13, found by hand: each printed a traceback
    ["profile", "llama", "--seq-len", "-4"],
    ["profile", "vit", "--batch-size", "100000000000"],
    ["doctor", "--size", "100GiB"],
    ["calibrate", "--sizes", "1MiB,100TiB"],
    ["profile", "llama", "--size", "70b"],  # a real 70B run: refused by the memory guard
    ["profile", "gpt2", "--seq-len", "0"],
    ["profile", "gpt2", "--depth", "-1"],
    ["profile", "gpt2", "--seq-len", "4096"],  # longer than the tiny preset's positions
]


def _vectors() -> list[list[str]]:
    out = []
    for base, options in SPECS.values():
        out += [[*base, flag, value] for flag, values in options.items() for value in values]
        out.append([*base, "--no-such-option"])
    return out + EXTRA


VECTORS = _vectors()


def test_the_sweep_is_large():
    assert len(VECTORS) >= 200
    assert {v[0] for v in VECTORS} >= {
        "doctor",
        "profile",
        "estimate",
        "plan",
        "ckpt",
        "calibrate",
        "demo",
    }


@pytest.mark.parametrize("argv", VECTORS, ids=lambda v: " ".join(v)[:80])
def test_bad_command_line_is_one_line_and_exit_2(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GPUMEM_DEBUG", raising=False)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith("gpumem") and ": error: " in err, err
    assert "Traceback" not in err and "Traceback" not in out
    assert out == "", out
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a demo directory
