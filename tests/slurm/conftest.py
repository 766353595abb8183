"""A private one-node Slurm for the tests in this directory: munged, slurmctld and slurmd on
localhost, two priority-tier partitions (``spot`` PriorityTier 1 and ``prio`` PriorityTier 10,
partition_prio preemption, REQUEUE, GraceTime 30 s) and a fake GPU GRES, all in a temporary
directory, stopped by PID. Skips with the reason where Slurm is not installed or cannot start
(it needs root: slurmd runs the jobs)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# the requeue hold (BeginTime) is the credential lifetime, 120 s by default: a requeued job that
# starts sooner on the same node is killed ("Job credential revoked")
CRED_EXPIRE_S = 10
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]

    def run(self, *argv: str) -> str:
        return subprocess.run(
            argv, env=self.env, capture_output=True, text=True, check=True, timeout=30
        ).stdout

    @staticmethod
    def free_port() -> int:
        """A TCP port free now (torchrun's rendezvous: never a fixed one)."""
        return free_port()

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as key=value pairs (JobState, Restarts, ...)."""
        text = subprocess.run(
            ["scontrol", "show", "job", job_id], env=self.env, capture_output=True, text=True
        ).stdout
        return dict(w.split("=", 1) for w in text.split() if "=" in w)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(d: Path, host: str, extra: str) -> str:
    return f"""ClusterName=gpumemtest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
MpiDefault=none
ReturnToService=2
KillWait=30
GresTypes=gpu
NodeName={host} CPUs={os.cpu_count() or 1} RealMemory=1000 Gres=gpu:2 State=UNKNOWN
PartitionName=spot Nodes={host} PriorityTier=1 GraceTime=30 Default=YES MaxTime=INFINITE State=UP
PartitionName=prio Nodes={host} PriorityTier=10 MaxTime=INFINITE State=UP
{extra}
"""


@pytest.fixture(scope="module")
def slurm(request, tmp_path_factory):
    """The cluster; ``pytest.mark.parametrize("slurm", [LINE], indirect=True)`` adds a line to
    its slurm.conf (a cluster of its own: the other one is stopped first)."""
    missing = [exe for exe in DAEMONS if shutil.which(exe) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing: slurm-wlm, munge)")
    if os.geteuid() != 0:
        pytest.skip("a private slurmd runs jobs as their users: it needs root")
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    host = socket.gethostname().split(".")[0]
    (d / "slurm.conf").write_text(_config(d, host, getattr(request, "param", "")))
    # two fake GPUs: device files that exist everywhere (slurmd counts the File= entries)
    (d / "gres.conf").write_text(
        "".join(f"NodeName={host} Name=gpu File={f}\n" for f in ("/dev/null", "/dev/zero"))
    )
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    procs: list[subprocess.Popen] = []
    log = open(d / "daemons.log", "w")  # noqa: SIM115 - closed at teardown
    try:
        procs.append(
            subprocess.Popen(
                [
                    "munged",
                    "-F",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={d}/munge.sock",
                    f"--pid-file={d}/munged.pid",
                    f"--seed-file={d}/munge.seed",
                    f"--log-file={d}/munged.log",
                ],
                stdout=log,
                stderr=log,
            )
        )
        _wait(lambda: (d / "munge.sock").exists(), "munged", d)
        conf = str(d / "slurm.conf")
        procs.append(
            subprocess.Popen(["slurmctld", "-D", "-i", "-f", conf], env=env, stdout=log, stderr=log)
        )
        procs.append(
            subprocess.Popen(["slurmd", "-D", "-f", conf], env=env, stdout=log, stderr=log)
        )
        _wait(lambda: _idle(env), "slurmctld and slurmd", d)
        yield Cluster(d, env)
    finally:
        for p in reversed(procs):  # by PID, the ones this fixture started
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        log.close()


def _idle(env: dict[str, str]) -> bool:
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
    return r.returncode == 0 and "idle" in r.stdout


def _wait(ready, what: str, d: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            tail = (d / "daemons.log").read_text()[-300:]
            pytest.skip(f"Slurm could not start here ({what} not ready in {timeout_s:g} s): {tail}")
        time.sleep(0.5)
