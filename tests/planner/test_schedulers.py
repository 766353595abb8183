"""Scheduler output that works when pasted: the Slurm script parses (bash -n), forwards SIGTERM
to the trainer it started and requeues (run here under stub srun/scontrol); the Kubernetes Job
is valid YAML with the fields Kubernetes requires and the preemption policy."""

import json
import os
import signal
import subprocess
import time

import pytest
import yaml

from gpumem.cli import main
from gpumem.planner import grace_seconds, k8s_job, sbatch_header


def test_grace_follows_the_persist_time():
    assert grace_seconds(0) == 60 and grace_seconds(29.9) == 60
    assert grace_seconds(30.2) == 61 and grace_seconds(150) == 300
    with pytest.raises(ValueError):
        grace_seconds(float("nan"))


def test_sbatch_script_parses_and_has_the_signal_set_up(tmp_path):
    s = sbatch_header(n_gpus=64, gpus_per_node=8, time_limit_min=240, signal_s=300)
    for line in ("#SBATCH --nodes=8", "#SBATCH --requeue", "#SBATCH --signal=B:TERM@300"):
        assert line in s.splitlines()
    assert "GraceTime" in s and "TRAINER_PID=$!" in s and "trap on_term TERM" in s
    path = tmp_path / "job.sh"
    path.write_text(s)
    bash = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr
    with pytest.raises(ValueError, match="multiple"):
        sbatch_header(n_gpus=12, gpus_per_node=8)


def test_sbatch_script_forwards_sigterm_and_requeues(tmp_path):
    """The script as Slurm runs it: SIGTERM to the batch shell reaches the trainer (under srun),
    the shell waits for it and calls `scontrol requeue` with the job id, and exits the trainer's
    code."""
    log = tmp_path / "log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "srun": '#!/bin/bash\nexec "$@"\n',
        "scontrol": f'#!/bin/bash\necho "scontrol $*" >> {log}\n',
        "trainer": (
            "#!/bin/bash\n"
            f"trap 'echo trainer-got-term >> {log}; exit 143' TERM\n"
            f"echo trainer-started >> {log}\n"
            "while true; do sleep 0.05; done\n"
        ),
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(sbatch_header(n_gpus=8, signal_s=120, command=str(bin_dir / "trainer")))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    proc = subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (log.exists() and "trainer-started" in log.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "trainer did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 does
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert log.read_text().splitlines() == [
        "trainer-started",
        "trainer-got-term",
        "scontrol requeue 4242",
    ]
    assert "forwarding it to the trainer" in err


def test_k8s_job_is_valid_and_requeues_on_the_trainer_exit_code():
    text = k8s_job(n_gpus=16, gpus_per_node=8, grace_s=300, layout="dp2/tp8/pp1")
    job = yaml.safe_load(text)
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert job["metadata"]["name"] and job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    spec = job["spec"]
    assert spec["parallelism"] == spec["completions"] == 2 and spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert pod["terminationGracePeriodSeconds"] == 300
    (container,) = pod["containers"]
    assert container["name"] == "trainer" and container["image"]
    assert container["command"] == ["python", "train.py"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    rules = spec["podFailurePolicy"]["rules"]
    exit_rule = next(r for r in rules if "onExitCodes" in r)
    assert exit_rule["action"] == "Ignore"
    assert exit_rule["onExitCodes"] == {
        "containerName": "trainer",
        "operator": "In",
        "values": [143],
    }
    evict = next(r for r in rules if "onPodConditions" in r)
    assert evict == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    for r in rules:  # what the API server validates
        assert r["action"] in ("Ignore", "FailJob", "Count", "FailIndex")
    with pytest.raises(ValueError):
        k8s_job(n_gpus=8, exit_code=0)


@pytest.mark.parametrize("flag", ["--slurm", "--k8s"])
def test_cli_grace_comes_from_the_persist_time(capsys, flag):
    argv = ["plan", "gpt2", "--gpus", "8", "--persist-s", "100", "--stall-s", "2", flag, "--json"]
    assert main(argv) == 0
    script = json.loads(capsys.readouterr().out)["script"]
    if flag == "--slurm":
        assert "#SBATCH --signal=B:TERM@200" in script
    else:
        assert (
            yaml.safe_load(script)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            == 200
        )
