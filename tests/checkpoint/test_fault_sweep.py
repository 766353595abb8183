"""The I/O fault sweep of issue 39 (``fault_sweep``): EIO, ENOSPC and EINTR in the N-th open,
write, read, fsync, fdatasync, rename, close, unlink or mkdir of a plain save and restore, in the
native core and in Python alike (an LD_PRELOAD shim; gcc builds it here).

CI runs a sample (``fault_sweep.sweep_cases``: every kind x errno at the first and the last call,
and the first call on each file the kind touches: the lock, a data file, the pointer, ...);
``--runslow`` every N (``benchmarks/bench_faults.py`` writes the same sweep's table). Each
(phase, kind, errno) is one test, so the summary line counts them; the number of cases is printed.

Per case: a CheckpointError or success, never a hang, a bare OSError or another exception; the
fault named (errno and path); EINTR retried (the operation succeeds); then, in a fresh process
without faults, no temporary directory survives the open, the previous committed step and the
newest one restore bit-identically against their seeds, and a save reported done is the newest.
"""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
from fault_sweep import (
    ERRNOS,
    KINDS,
    PHASES,
    RAN,
    Case,
    Result,
    build_shim,
    counted,
    run_cases,
    strace_counts,
    sweep_cases,
)

# what a plain save and a plain restore (a resumed job's Checkpointer(root)) must make: a kind
# missing here means the sweep stopped reaching it
SAVE_KINDS = ("open", "write", "fsync", "fdatasync", "rename", "close", "unlink", "mkdir")
RESTORE_KINDS = ("open", "read", "close")


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    so = build_shim(tmp_path_factory.mktemp("shim"))
    if so is None:
        pytest.skip("no C compiler (gcc) to build the fault injector: the sweep cannot run")
    return so


@cache
def _sweep(shim: Path, base: Path, full: bool) -> tuple[dict, list[Result]]:
    counting = run_cases([Case(p, "", "", 0) for p in PHASES], shim, base, 300)
    counts, cases = counted(counting), sweep_cases(counting, full)
    if not any(counts["save"].values()):
        pytest.skip("the LD_PRELOAD shim sees no calls here (a statically linked Python?)")
    results = run_cases(cases, shim, base, 3000 if full else 600)
    hangs = sum(r.outcome == "hang" for r in results)
    RAN.append(
        f"fault sweep ({'every N' if full else 'sample'}): {len(results)} cases ran, {hangs} hung"
    )
    return counts, results


@pytest.fixture(scope="module")
def sample(shim, tmp_path_factory) -> tuple[dict, list[Result]]:
    return _sweep(shim, tmp_path_factory.mktemp("sweep"), False)


def _violations(results: list[Result], phase: str, kind: str, err: str) -> list[str]:
    mine = [r for r in results if (r.case.phase, r.case.kind, r.case.err) == (phase, kind, err)]
    assert mine, f"no {phase} case faults {kind} with {err}"
    assert all(r.hit for r in mine), "a case whose fault never fired: the counts moved"
    return [
        f"{r.case.kind} #{r.case.n} {r.case.err}: {'; '.join(r.violations)} ({r.error[:200]})"
        for r in mine
        if r.violations
    ]


def test_a_plain_save_and_restore_make_every_kind_of_call(sample):
    counts, _ = sample
    assert [k for k in SAVE_KINDS if counts["save"][k] == 0] == []
    assert [k for k in RESTORE_KINDS if counts["restore"][k] == 0] == []


@pytest.mark.parametrize("err", ERRNOS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("phase", PHASES)
def test_fault_sample(sample, phase, kind, err):
    counts, results = sample
    if counts[phase][kind] == 0:
        pytest.skip(f"a plain {phase} makes no {kind} call under the root")
    assert _violations(results, phase, kind, err) == []


@pytest.mark.slow
def test_the_full_sweep(shim, tmp_path_factory):
    _, results = _sweep(shim, tmp_path_factory.mktemp("full"), True)
    bad = [
        f"{r.case}: {'; '.join(r.violations)} ({r.error[:200]})" for r in results if r.violations
    ]
    assert bad == []


def _ptrace_works() -> bool:
    if shutil.which("strace") is None:
        return False
    try:
        return (
            subprocess.run(["strace", "-qq", "-o", "/dev/null", "true"], timeout=30).returncode == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _ptrace_works(), reason="strace is not installed or ptrace is refused")
def test_the_shim_counts_every_call_strace_sees(shim, tmp_path):
    """strace reports system calls whoever makes them (libc inside, the native core, Python);
    the shim interposes libc's entry points. The same counts mean no path escapes the sweep."""
    traced, shimmed = strace_counts(shim, tmp_path, 300)
    assert traced == shimmed
    assert traced["save"]["write"] > 0 and traced["restore"]["read"] > 0
