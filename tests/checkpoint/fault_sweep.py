"""The I/O fault sweep of issue 39: EIO, ENOSPC and EINTR injected into the N-th open, write,
read, fsync, fdatasync, rename, close, unlink or mkdir that a plain save (or restore) makes, for
every N, in the native core and in Python alike.

How: ``faultshim.c`` (compiled here with gcc) is LD_PRELOADed into a driver process
(``python fault_sweep.py``), which imports torch and gpumem once, makes a template root without
faults and forks one child per case on a copy of it. The child arms the shim (only calls that
touch a file under the root count), runs the operation under the fault, disarms and reports. A
second fork, a fresh process with no fault, then checks the invariants: the root opens, no
temporary directory survives that open, the newest committed step and the previous one restore
bit-identically against their reference states (regenerated from the seeds). A child that
outlives the watchdog is killed and reported as a hang.

The scenario (``keep=2``): steps 1 and 2 are committed; the faulted save is step 3 (its commit
makes retention remove step 1); the faulted restore is a resumed job's plain ``Checkpointer(root)``
and ``restore()`` of step 2.

Outcomes, per case: ``ok`` (no exception), ``CheckpointError`` (a subclass named in ``error``),
``bare OSError``, ``other`` (another exception, or the child died), ``hang``. Violations
(``violations``): a bare OSError, another error, a hang, a lost or altered committed step, a
temporary directory that survives the next open, a CheckpointError that does not name the errno
and the full path of the file whose call failed, a restore that returned other bytes than saved,
an EINTR that failed the operation (EINTR is to be retried: Python does, PEP 475; so must the
native core).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHIM_SOURCE = HERE / "faultshim.c"
KINDS = ("open", "write", "read", "fsync", "fdatasync", "rename", "close", "unlink", "mkdir")
ERRNOS = ("EIO", "ENOSPC", "EINTR")
PHASES = ("save", "restore")
WATCHDOG_S = 60.0
LEFTOVERS = (".tmp-", ".trash-", ".latest.tmp-", ".replaced-")
SAVED_STEP, FAULTED_STEP = 2, 3
RAN: list[str] = []  # "fault sweep (...): N cases ran", for the test run's summary (conftest)
MARK = "/faultshim-mark"  # a path no file has: the access() calls that bracket a case
# the system calls behind each kind, as strace names them
SYSCALLS = {
    "open": ("open", "openat", "creat"),
    "write": ("write", "pwrite64", "writev", "pwritev", "pwritev2"),
    "read": ("read", "pread64", "readv", "preadv", "preadv2"),
    "fsync": ("fsync",),
    "fdatasync": ("fdatasync",),
    "rename": ("rename", "renameat", "renameat2"),
    "close": ("close",),
    "unlink": ("unlink", "unlinkat", "rmdir"),
    "mkdir": ("mkdir", "mkdirat"),
}


@dataclass(frozen=True)
class Case:
    """One fault: the ``n``-th call of ``kind`` made by ``phase`` fails with ``err``
    (``kind`` "": count the calls, inject nothing)."""

    phase: str
    kind: str
    err: str
    n: int


@dataclass
class Result:
    case: Case
    outcome: str = "ok"  # ok, CheckpointError, bare OSError, other, hang
    error: str = ""  # the exception's type and message
    hit: str = ""  # the call the shim failed ("" when the n-th call never came)
    counts: dict[str, int] = field(default_factory=dict)
    calls: list[list[Any]] = field(default_factory=list)  # counting: [kind, n, path in root]
    committed: bool | None = None  # what the faulted save reported
    restored: int | None = None  # the step the faulted restore returned
    check: dict[str, Any] = field(default_factory=dict)  # the fresh process's findings
    violations: list[str] = field(default_factory=list)


def build_shim(out_dir: Path) -> Path | None:
    """Compile the shim into ``out_dir``; None when gcc is missing or fails (the caller skips)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        return None
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()[:12]
    so = out_dir / f"faultshim-{digest}.so"
    if not so.exists():
        cmd = [gcc, "-shared", "-fPIC", "-O1", "-o", str(so), str(SHIM_SOURCE), "-ldl"]
        if subprocess.run(cmd, capture_output=True, timeout=120).returncode != 0:
            return None
    return so


def run_cases(
    cases: list[Case], shim: Path, base: Path, timeout_s: float, prefix: list[str] | None = None
) -> list[Result]:
    """Run ``cases`` in one driver process under the shim (and ``prefix``: strace); each case
    in its own forks."""
    base.mkdir(parents=True, exist_ok=True)
    base = base.resolve()  # the paths in messages are then the ones the shim reports
    todo, done = base / "cases.json", base / "results.jsonl"
    todo.write_text(json.dumps([asdict(c) for c in cases]))
    done.unlink(missing_ok=True)
    env = dict(os.environ, LD_PRELOAD=str(shim), PYTHONPATH=_pythonpath())
    env.setdefault("GPUMEM_THREADS", "2")
    cmd = [sys.executable, str(Path(__file__)), str(todo), str(done), str(base), str(WATCHDOG_S)]
    cmd = [*(prefix or []), *cmd]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    results = [_result(json.loads(line)) for line in done.read_text().splitlines()]
    if proc.returncode != 0 or len(results) != len(cases):
        raise RuntimeError(
            f"the fault driver stopped after {len(results)} of {len(cases)} cases "
            f"(exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    return results


def _pythonpath() -> str:
    repo = str(HERE.parent.parent)
    rest = os.environ.get("PYTHONPATH", "")
    return repo + (os.pathsep + rest if rest else "")


def _result(d: dict[str, Any]) -> Result:
    return Result(**{**d, "case": Case(**d["case"])})


def strace_counts(shim: Path, base: Path, timeout_s: float) -> tuple[dict, dict]:
    """A fault-free save and restore traced by strace as well as counted by the shim: (per
    phase, the calls of each kind that touched the root as strace saw them, as the shim did).
    strace sees system calls, whoever makes them; equal counts mean the shim misses none."""
    log = base / "strace.log"
    calls = ",".join(c for kind in KINDS for c in SYSCALLS[kind])
    prefix = ["strace", "-f", "-qq", "-y", "-o", str(log), f"-etrace={calls},access,faccessat2"]
    res = run_cases([Case(p, "", "", 0) for p in PHASES], shim, base, timeout_s, prefix)
    root = str(base.resolve()) + "/case-"
    kind_of = {c: kind for kind in KINDS for c in SYSCALLS[kind]}
    seen: dict[str, dict[str, int]] = {}
    phase = None
    for line in log.read_text().splitlines():
        name = line.split(None, 1)[1].split("(", 1)[0] if " " in line else ""
        if MARK in line:
            phase = line.split(f"{MARK}-begin-", 1)[1].split('"')[0] if "-begin-" in line else None
            seen.setdefault(phase or "", dict.fromkeys(KINDS, 0))
        elif phase and name in kind_of and root in line:
            seen[phase][kind_of[name]] += 1
    seen.pop("", None)
    return seen, counted(res)


def counted(results: list[Result]) -> dict[str, dict[str, int]]:
    """Per phase, the calls of each kind a fault-free run made (from counting cases)."""
    return {r.case.phase: r.counts for r in results if not r.case.kind}


def role(path: str) -> str:
    """What a file is to the checkpoint, whatever its step, rank or number:
    ``.tmp-step-#/data-r#-#.bin``, ``.lock``, ``step-#/MANIFEST``, ... ("" for the root)."""
    return re.sub(r"\d+", "#", path)


def sweep_cases(counting: list[Result], full: bool) -> list[Case]:
    """Every kind a phase makes x every errno x N: 1..count (``full``). Else a sample: every
    errno at the first and the last call, and EIO and EINTR at the first call on each file
    role (the lock, a data file, the temporary directory, the pointer, ...), so that every
    place a fault was found is in it (ENOSPC takes the paths EIO takes)."""
    cases = []
    for r in counting:
        for kind in KINDS:
            c = r.counts.get(kind, 0)
            firsts: dict[str, int] = {}
            for k, n, path in r.calls:
                if k == kind:
                    firsts.setdefault(role(path), n)
            for err in ERRNOS:
                ns: Iterable[int] = range(1, c + 1) if full else {1, c}
                if not full and err != "ENOSPC":
                    ns = {*ns, *firsts.values()}
                cases += [Case(r.case.phase, kind, err, n) for n in sorted(ns) if c]
    return cases


# ------------------------------------------------------------------ the driver (child side)


def _state(step: int) -> Any:
    """The reference model of ``step``: regenerated from its seed, so a restore is compared with
    an independent copy, never with what the checkpoint says."""
    import torch

    torch.manual_seed(step)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))


def _same(a: Any, b: Any) -> bool:
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _checkpointer(root: Path) -> Any:
    import gpumem

    # 256 KiB of staging: the state goes out as several data files, written concurrently
    return gpumem.Checkpointer(
        root, keep=2, staging_bytes=256 << 10, chunk_bytes=64 << 10, lock_timeout_s=5
    )


def _setup(root: Path, out: dict[str, Any]) -> None:
    """The template root every case copies (steps 1 and 2 committed), and the modules a save
    and a restore import, which the driver then imports before it forks (a case child then
    spends its time on the case, not on imports)."""
    before = set(sys.modules)
    with _checkpointer(root) as ck:
        for step in range(1, SAVED_STEP + 1):
            ck.save(step, model=_state(step))
            ck.wait()
    _check(root, {})
    out["modules"] = sorted(set(sys.modules) - before)


def _classify(exc: BaseException) -> tuple[str, str]:
    from gpumem.checkpoint import CheckpointError

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, CheckpointError):
        return "CheckpointError", text
    if isinstance(exc, OSError):
        return "bare OSError", text
    return "other", text


def _faulted(case: Case, root: Path, shim: Any, out: dict[str, Any]) -> None:
    """In the case's child: the operation under the fault, its outcome into ``out``."""
    import warnings

    warnings.simplefilter("ignore")  # warnings are allowed; errors are what is checked
    kind = KINDS.index(case.kind) if case.kind else -1
    code = getattr(errno, case.err) if case.err else 0
    where = str(root.resolve())  # the shim compares with /proc/self/fd's links

    log = os.open(root.parent / f"calls-{root.name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

    def arm() -> None:
        os.access(f"{MARK}-begin-{case.phase}", os.F_OK)  # the window, for strace_counts
        shim.faultshim_arm(where.encode(), kind, code, case.n, -1 if case.kind else log)

    try:
        if case.phase == "save":
            ck = _checkpointer(root)  # opened before the fault: the save is what is swept
            arm()
            out["committed"] = False
            try:
                stats = ck.save(FAULTED_STEP, model=_state(FAULTED_STEP))
                try:
                    ck.wait()
                finally:
                    out["committed"] = bool(stats.committed)
            finally:
                ck.close()
        else:
            arm()  # a resumed job: the open is part of it
            fresh = _state(0)
            with _checkpointer(root) as ck:
                out["restored"] = ck.restore(model=fresh)
            out["restored_same"] = _same(fresh, _state(out["restored"] or 0))
    except BaseException as exc:
        out["outcome"], out["error"] = _classify(exc)
    finally:
        shim.faultshim_disarm()
        os.access(f"{MARK}-end", os.F_OK)
    os.close(log)
    calls = (root.parent / f"calls-{root.name}.log").read_text().splitlines()
    out["calls"] = [
        [k, int(n), p[len(str(where)) :]] for k, n, p in (c.split(" ", 2) for c in calls)
    ]
    out["hit"] = shim.faultshim_hit().decode()
    out["counts"] = {k: shim.faultshim_count(i) for i, k in enumerate(KINDS)}


def _check(root: Path, out: dict[str, Any]) -> None:
    """In a fresh process, no fault: what the next job finds (the next open cleans up)."""
    import warnings

    warnings.simplefilter("ignore")
    try:
        with _checkpointer(root) as ck:
            out["left"] = sorted(p.name for p in root.iterdir() if p.name.startswith(LEFTOVERS))
            out["steps"] = [info.step for info in ck.list()]
            fresh = _state(0)
            out["latest"] = ck.restore(model=fresh)
            out["latest_same"] = _same(fresh, _state(out["latest"] or 0))
            prev = _state(0)
            got = ck.restore(model=prev, path=root / f"step-{SAVED_STEP:09d}")
            out["previous_same"] = got == SAVED_STEP and _same(prev, _state(SAVED_STEP))
    except BaseException as exc:
        out["failed"] = "{}: {}".format(*_classify(exc)[::-1])


def _in_child(fn: Any, *args: Any) -> tuple[str, dict[str, Any]]:
    """``fn(*args, out)`` in a forked child under the watchdog: ("done" | "hang" | "died: ...",
    out)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into the driver
        os.close(r)
        out: dict[str, Any] = {}
        try:
            import torch

            torch.set_num_threads(1)
            fn(*args, out)
            data = json.dumps(out, default=str).encode()
        except BaseException as exc:  # the harness itself failed
            data = json.dumps({"died": f"{type(exc).__name__}: {exc}"}).encode()
        os.write(w, data)
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + WATCHDOG_S
    while time.monotonic() < deadline:
        wpid, status = os.waitpid(pid, os.WNOHANG)
        if wpid:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        return "hang", {}
    with os.fdopen(r, "rb") as f:
        data = f.read()
    if not data:
        return f"died: status {status}", {}
    out = json.loads(data)
    return ("died: " + out["died"], {}) if "died" in out else ("done", out)


def _judge(case: Case, res: Result) -> None:
    """The invariants of the module docstring, as violations."""
    v, chk = res.violations, res.check
    if res.outcome in ("bare OSError", "other", "hang"):
        v.append(res.outcome)
    if case.err == "EINTR" and res.outcome != "ok":
        v.append("EINTR not retried")
    if res.outcome == "CheckpointError" and res.hit:
        named = os.strerror(getattr(errno, case.err)) in res.error or case.err in res.error
        faulted = res.hit.split(" ", 2)[2]  # the file whose call failed, in full
        if not (named and faulted in res.error):
            v.append("fault not named (errno and path)")
    if case.phase == "restore" and res.outcome == "ok" and res.restored != SAVED_STEP:
        v.append(f"restored step {res.restored}, not {SAVED_STEP}")
    if res.restored is not None and not res.check.get("restored_same", True):
        v.append("restored other bytes")
    if "failed" in chk:
        v.append(f"next open/restore failed: {chk['failed']}")
        return
    if chk.get("left"):
        v.append(f"left {', '.join(chk['left'])}")
    if not chk.get("previous_same"):
        v.append(f"lost step {SAVED_STEP}")
    if not chk.get("latest_same"):
        v.append(f"latest step {chk.get('latest')} differs")
    failed = case.phase == "save" and res.outcome != "ok" and not res.committed
    if failed and chk.get("latest") == FAULTED_STEP:
        v.append(f"step {FAULTED_STEP} committed, save reported failed")
    want = FAULTED_STEP if case.phase == "save" and res.outcome == "ok" else None
    if want is not None and chk.get("latest") != want:
        v.append(f"step {want} reported saved, restore found {chk.get('latest')}")


def run_one(case: Case, base: Path, index: int, shim: Any) -> Result:
    root = base / f"case-{index}"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(base / "template", root)
    res = Result(case)
    status, out = _in_child(_faulted, case, root, shim)
    if status != "done":
        res.outcome, res.error = ("hang", "") if status == "hang" else ("other", status)
    else:
        res.outcome, res.error = out.get("outcome", "ok"), out.get("error", "")
        res.hit, res.counts = out.get("hit", ""), out.get("counts", {})
        res.calls = out.get("calls", [])
        res.committed, res.restored = out.get("committed"), out.get("restored")
        res.check["restored_same"] = out.get("restored_same", True)
    status, chk = _in_child(_check, root)
    res.check.update(chk if status == "done" else {"failed": status})
    _judge(case, res)
    shutil.rmtree(root, ignore_errors=True)
    return res


def _load_shim() -> Any:
    shim = ctypes.CDLL(None)  # LD_PRELOADed: its symbols are the process's
    shim.faultshim_arm.argtypes = [
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
        ctypes.c_int,
    ]
    shim.faultshim_count.restype = ctypes.c_long
    shim.faultshim_hit.restype = ctypes.c_char_p
    return shim


def main(argv: list[str]) -> int:
    todo, done, base, watchdog = argv
    global WATCHDOG_S
    WATCHDOG_S = float(watchdog)
    import torch  # noqa: F401  imported once, before the forks

    import gpumem  # noqa: F401

    shim = _load_shim()
    template = Path(base) / "template"
    shutil.rmtree(template, ignore_errors=True)
    template.mkdir()
    status, out = _in_child(_setup, template)
    if status != "done":
        raise RuntimeError(f"setting up {template} failed: {status}")
    for name in out["modules"]:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    cases = [Case(**c) for c in json.loads(Path(todo).read_text())]
    with open(done, "a") as f:
        for i, case in enumerate(cases):
            res = run_one(case, Path(base), i, shim)
            f.write(json.dumps(asdict(res)) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    tempfile.tempdir = None
    sys.exit(main(sys.argv[1:]))
