"""The CLI's guard rails: --debug tracebacks, a closed pipe, one-line warnings, progress only on
a terminal, and the memory guard before a real profile (and the warning of gpumem.profile)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

import gpumem
from gpumem.cli import main
from gpumem.cli._progress import progress_bar


def test_debug_shows_the_traceback_and_the_line(capsys, monkeypatch):
    monkeypatch.delenv("GPUMEM_DEBUG", raising=False)
    assert main(["profile", "nosuchmodel"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    for argv, env in ((["profile", "nosuchmodel", "--debug"], None), (["profile", "x"], "1")):
        if env:
            monkeypatch.setenv("GPUMEM_DEBUG", env)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "ValueError" in err
        assert err.splitlines()[-1].startswith("gpumem profile: error: unknown model")


def test_unexpected_errors_are_one_line_too(capsys, monkeypatch):
    monkeypatch.delenv("GPUMEM_DEBUG", raising=False)

    def boom(*a, **k):
        raise RuntimeError("something\nbroke\n  badly")

    monkeypatch.setattr("gpumem.doctor.run_doctor", boom)
    assert main(["doctor", "--no-measure"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "gpumem doctor: error: RuntimeError: something broke badly (unexpected: rerun with "
        "--debug for the traceback, and report it with the command line)\n"
    )


def test_help_and_version_exit_0(capsys):
    assert main(["--help"]) == 0 and "demo" in capsys.readouterr().out
    assert main(["plan", "--help"]) == 0 and "--mtbf-hours" in capsys.readouterr().out
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("gpumem ")


def test_closed_pipe_exits_quietly():
    r, w = os.pipe()
    os.close(r)  # the reader went away before the first line, as `| head -0` does
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gpumem", "plan", "gpt2", "--gpus", "8"],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(w)
    assert proc.returncode == 141 and proc.stderr == ""


def test_warnings_are_one_line(capsys):
    assert main(["estimate", "llama-2-7b", "--seq-len", "8192"]) == 0
    out, err = capsys.readouterr()
    assert err == (
        "gpumem estimate: warning: seq_len 8192 is beyond llama-2-7b's context of 4096 tokens "
        "(max_position_embeddings): the model was not trained for it (rotary positions need "
        "scaling or further training there); memory is estimated as asked\n"
    )
    assert "seq_len 8192 (given)" in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# What rich reads of the environment to decide whether and how wide to draw: the test's own
# values, never the shell's (TERM=dumb, a narrow COLUMNS or TTY_INTERACTIVE=0 would hide the bar).
_RICH_ENV = (
    "TERM",
    "TTY_INTERACTIVE",
    "TTY_COMPATIBLE",
    "FORCE_COLOR",
    "NO_COLOR",
    "COLUMNS",
    "LINES",
)


def _terminal_env(monkeypatch, term: str) -> None:
    for name in _RICH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", term)
    monkeypatch.setenv("COLUMNS", "120")


def test_progress_only_on_a_terminal(monkeypatch):
    _terminal_env(monkeypatch, "xterm-256color")
    tty, pipe = _Terminal(), io.StringIO()
    for stream in (tty, pipe):
        with progress_bar("searching layouts", stream=stream) as update:
            update(3, 10)
    assert "searching layouts" in tty.getvalue()
    assert pipe.getvalue() == ""
    quiet = _Terminal()
    with progress_bar("x", enabled=False, stream=quiet) as update:  # --json
        update(1, 2)
    assert quiet.getvalue() == ""


def test_no_progress_on_a_dumb_terminal(monkeypatch):
    # a terminal that cannot redraw a line (TERM=dumb: Emacs shells, some CI logs) gets no bar
    _terminal_env(monkeypatch, "dumb")
    tty = _Terminal()
    with progress_bar("searching layouts", stream=tty) as update:
        update(3, 10)
    assert "searching layouts" not in tty.getvalue()


def test_json_output_is_only_json(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())  # even on a terminal: no bar with --json
    assert main(["plan", "gpt2", "--gpus", "8", "--json"]) == 0
    json.loads(capsys.readouterr().out)
    assert sys.stderr.getvalue() == ""


def test_memory_guard_refuses_a_real_run_that_cannot_fit(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        "gpumem.estimator.preflight.available_bytes", lambda device: (1 << 20, "available")
    )
    assert main(["profile", "gpt2", "--batch-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the 1.00 MiB available" in err and err.count("\n") == 1
    assert "`gpumem profile gpt2 --size tiny --batch-size 4 --fake`" in err
    assert main(["profile", "gpt2", "--batch-size", "4", "--fake"]) == 0  # the hint works
    assert main(["profile", "gpt2", "--batch-size", "4", "--force"]) == 0  # and --force
    assert "gpumem profile of" in capsys.readouterr().out


def test_memory_guard_estimate_is_near_the_real_peak():
    """The guard's estimate of a small run against the run itself (the estimator's CPU mode is
    what tests/estimator/test_vs_profiler.py holds to 5 %)."""
    from gpumem.estimator.preflight import profile_preflight
    from gpumem.profiler.runner import profile_model

    check = profile_preflight("llama", batch_size=2, seq_len=64)
    rep = profile_model("llama", batch_size=2, seq_len=64)
    assert check.method == "gpumem.estimate"
    assert abs(check.estimate_bytes - rep.peak_bytes) / rep.peak_bytes < 0.10


def test_profile_in_python_only_warns(monkeypatch):
    monkeypatch.setattr(
        "gpumem.profiler.headroom.available_bytes", lambda device: (1024, "available")
    )
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    # needs: gradients (64*64+64)*4 B, AdamW moments twice that
    warning = pytest.warns(gpumem.profiler.ProfileMemoryWarning, match="at least 48.75 KiB more")
    with warning, gpumem.profile(model, opt):
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
