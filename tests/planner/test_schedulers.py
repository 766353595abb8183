"""Scheduler output that works when pasted: the Slurm script parses (bash -n), forwards SIGTERM
to the trainer it started and requeues (run here under stub srun/scontrol); the Kubernetes Job
is read by the Kubernetes API's own models (the pinned ``kubernetes`` client) and its PID 1
forwards SIGTERM (run here under dash). The SkyPilot task: tests/planner/test_sky_task.py."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from kubernetes.client import ApiClient

from gpumem.cli import main
from gpumem.planner import grace_seconds, k8s_job, sbatch_header
from gpumem.planner.kube_job import ENTRYPOINT

K8S = ApiClient()


def test_grace_follows_the_persist_time():
    assert grace_seconds(0) == 60 and grace_seconds(29.9) == 60
    assert grace_seconds(30.2) == 61 and grace_seconds(150) == 300
    with pytest.raises(ValueError):
        grace_seconds(float("nan"))


def test_sbatch_script_parses_and_has_the_signal_set_up(tmp_path):
    s = sbatch_header(n_gpus=64, gpus_per_node=8, time_limit_min=240, signal_s=300)
    for line in ("#SBATCH --nodes=8", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@300"):
        assert line in s.splitlines()
    assert "#SBATCH --ntasks-per-node=8" in s.splitlines()
    assert "GraceTime" in s and "BeginTime" in s and "minimum lead" in s
    assert "send_user_signal" in s and "scancel --batch --signal=USR1" in s
    assert 'kill -TERM "${TRAINER_PID}"' not in s  # srun answers SIGTERM by SIGKILLing its tasks
    _bash_n(tmp_path, s)
    with pytest.raises(ValueError, match="multiple"):
        sbatch_header(n_gpus=12, gpus_per_node=8)


def test_sbatch_torchrun_runs_one_task_per_node(tmp_path):
    s = sbatch_header(n_gpus=16, gpus_per_node=8, launcher="torchrun")
    assert "#SBATCH --ntasks-per-node=1" in s.splitlines()
    assert "#SBATCH --gpus-per-node=8" in s.splitlines()
    assert "TRAIN_CMD=(torchrun --nnodes=${SLURM_NNODES} --nproc-per-node=8 " in s
    assert "train.py)" in s and "HEAD_NODE=$(scontrol show hostnames" in s
    _bash_n(tmp_path, s)


def _bash_n(tmp_path, script):
    path = tmp_path / "job.sh"
    path.write_text(script)
    bash = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr


def _run_script(tmp_path, *, trainer_exit, shell_signal=None, trainer_signal=False):
    """The script as Slurm runs it, under stubs that behave as Slurm 22.05 did (issue #38):
    srun SIGKILLs its task on SIGTERM and passes USR1 on; `scancel --signal=TERM` signals the
    task directly. The trainer exits ``trainer_exit`` on SIGTERM or SIGUSR1 (torchrun exits 1).
    Returns the script's exit status, the event log and its stderr."""
    log, pid_file, bin_dir = tmp_path / "log", tmp_path / "trainer.pid", tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "srun": (
            "#!/bin/bash\n"
            '"$@" & child=$!\n'
            f"trap 'echo srun-got-term >> {log}; kill -KILL $child' TERM\n"
            "trap 'kill -USR1 $child' USR1\n"
            'while :; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || exit "$rc"; done\n'
        ),
        "scontrol": f'#!/bin/bash\necho "scontrol $*" >> {log}\n',
        "scancel": (
            f'#!/bin/bash\necho "scancel $*" >> {log}\n'
            f'[ "$1" = --signal=TERM ] && kill -TERM "$(cat {pid_file})"\n'
        ),
        "trainer": (
            "#!/bin/bash\n"
            f"echo $$ > {pid_file}\n"
            f"trap 'echo trainer-got-term >> {log}; exit {trainer_exit}' TERM\n"
            f"trap 'echo trainer-got-usr1 >> {log}; exit {trainer_exit}' USR1\n"
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
    while not (log.exists() and "trainer-started" in log.read_text() and pid_file.exists()):
        assert time.monotonic() < deadline and proc.poll() is None, "trainer did not start"
        time.sleep(0.05)
    time.sleep(0.2)  # the stubs' traps are set
    if shell_signal is not None:
        proc.send_signal(shell_signal)
    if trainer_signal:  # Slurm signals the tasks itself (preemption, scancel, scontrol requeue)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
    if shell_signal is None and not trainer_signal:
        os.kill(int(pid_file.read_text()), signal.SIGUSR1)  # a trainer that stops on its own
    _, err = proc.communicate(timeout=20)
    return proc.returncode, log.read_text().splitlines(), err


@pytest.mark.parametrize("trainer_exit", [143, 1], ids=["srun", "torchrun-exits-1"])
def test_time_limit_signals_the_tasks_not_srun_and_requeues(tmp_path, trainer_exit):
    """--signal=B:USR1 reaches the shell: SIGTERM goes to the tasks through scancel (srun, sent
    SIGTERM, would SIGKILL them: no final save), and the job is requeued whatever the exit status
    (torchrun exits with its own)."""
    rc, log, err = _run_script(tmp_path, trainer_exit=trainer_exit, shell_signal=signal.SIGUSR1)
    assert rc == trainer_exit, err
    assert log == [
        "trainer-started",
        "scancel --signal=TERM 4242",
        "trainer-got-term",
        "scontrol requeue 4242",
    ], err
    assert "SIGUSR1: SIGTERM to the trainer tasks" in err and "requeueing job 4242" in err


def test_preemption_requeues_on_the_trainer_exit_code(tmp_path):
    """Preemption without send_user_signal: Slurm signals the tasks, not the shell; the trainer
    exits 143 after its final save and the script requeues (else the job ends FAILED)."""
    rc, log, err = _run_script(tmp_path, trainer_exit=143, trainer_signal=True)
    assert rc == 143, err
    assert log == ["trainer-started", "trainer-got-term", "scontrol requeue 4242"], err


def test_cancel_is_not_turned_into_a_requeue(tmp_path):
    """scancel or scontrol requeue: SIGTERM to the shell and the tasks; the script neither
    forwards it to srun nor requeues the job (Slurm decides)."""
    rc, log, err = _run_script(
        tmp_path, trainer_exit=143, shell_signal=signal.SIGTERM, trainer_signal=True
    )
    assert rc == 143, err
    assert log == ["trainer-started", "trainer-got-term"], err
    assert "cancelled or requeued by Slurm" in err


def test_a_trainer_that_finishes_is_not_requeued(tmp_path):
    rc, log, err = _run_script(tmp_path, trainer_exit=0)
    assert rc == 0, err
    assert log == ["trainer-started", "trainer-got-usr1"], err


def _k8s(text):
    """Each document as the Kubernetes API's own models read it (the pinned ``kubernetes``
    client, generated from the API's OpenAPI schema): a missing required field or a wrong type
    raises, and a field the model does not know (a typo, a wrong level) is dropped, so the
    round trip must give the document back unchanged."""
    out = {}
    for doc in yaml.safe_load_all(text):
        kind = doc["kind"]
        obj = K8S.deserialize(json.dumps(doc), f"V1{kind}", "application/json")
        assert K8S.sanitize_for_serialization(obj) == doc, kind
        out[kind] = doc
    return out


def test_k8s_validator_rejects_broken_manifests():
    """The check can fail: a missing required field, a wrong type, an unknown field."""
    job = _k8s(k8s_job(n_gpus=8))["Job"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    broken = [
        {**container, "name": None},
        {**container, "args": "torchrun train.py"},
        {**container, "resource": container["resources"]},
    ]
    for c in broken:
        job["spec"]["template"]["spec"]["containers"] = [c]
        with pytest.raises((AssertionError, ValueError)):
            _k8s(yaml.safe_dump(job))
    pod = job["spec"]["template"]["spec"]
    pod["containers"], pod["terminationGracePeriodSeconds"] = [container], "60s"
    with pytest.raises(ValueError, match="terminationGracePeriodSeconds"):
        _k8s(yaml.safe_dump(job))


def test_k8s_job_is_valid_and_requeues_on_the_trainer_exit_code():
    text = k8s_job(n_gpus=16, gpus_per_node=8, final_save_s=150, layout="dp2/tp8/pp1")
    docs = _k8s(text)
    assert list(docs) == ["PriorityClass", "Service", "Job"]
    prio, svc, job = docs["PriorityClass"], docs["Service"], docs["Job"]
    assert prio["preemptionPolicy"] == "Never" and prio["value"] < 0  # below ordinary pods
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    spec = job["spec"]
    assert spec["parallelism"] == spec["completions"] == 2 and spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert pod["priorityClassName"] == prio["metadata"]["name"]
    assert pod["terminationGracePeriodSeconds"] == 300  # twice the 150 s final save
    # torchrun's rendezvous host is the first pod, through the headless Service
    assert svc["spec"]["clusterIP"] == "None" and pod["subdomain"] == svc["metadata"]["name"]
    (container,) = pod["containers"]
    assert container["name"] == "trainer" and container["image"]
    assert container["command"][:2] == ["/bin/sh", "-c"] and container["command"][2] == ENTRYPOINT
    assert container["args"][0] == "torchrun" and container["args"][-1] == "train.py"
    assert "--rdzv-endpoint=gpumem-train-0.gpumem-train:29500" in container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
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


def _entrypoint(tmp_path, *, trainer_exit, stop):
    """The container's PID 1 under dash (a POSIX sh, as slim images have) with a stub trainer:
    the kubelet's SIGTERM (``stop``) or a trainer that ends on its own."""
    sh = shutil.which("dash") or "/bin/sh"
    log, pid = tmp_path / "log", tmp_path / "pid"
    trainer = tmp_path / "trainer"
    trainer.write_text(
        "#!/bin/sh\n"
        f"echo $$ > {pid}\n"
        f"trap 'echo got-term >> {log}; exit {trainer_exit}' TERM\n"
        "while :; do sleep 0.05; done\n"
    )
    trainer.chmod(0o755)
    proc = subprocess.Popen([sh, "-c", ENTRYPOINT, "sh", str(trainer), "arg"])
    deadline = time.monotonic() + 10
    while not pid.exists() or not pid.read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)
    if stop:
        proc.send_signal(signal.SIGTERM)
    else:
        os.kill(int(pid.read_text()), signal.SIGTERM)
    return proc.wait(timeout=10), log.read_text()


@pytest.mark.parametrize("trainer_exit", [143, 1, 0], ids=["guard", "torchrun-exits-1", "done"])
def test_k8s_entrypoint_forwards_sigterm_and_asks_for_a_new_pod(tmp_path, trainer_exit):
    """SIGTERM to PID 1 reaches the trainer, which saves; PID 1 then exits 143 whatever the
    trainer's status (torchrun's is its own), so podFailurePolicy recreates the pod."""
    rc, log = _entrypoint(tmp_path, trainer_exit=trainer_exit, stop=True)
    assert log == "got-term\n" and rc == 143


def test_k8s_entrypoint_passes_the_trainer_status_on(tmp_path):
    rc, _ = _entrypoint(tmp_path, trainer_exit=3, stop=False)
    assert rc == 3  # a failure that no stop caused counts against backoffLimit


@pytest.mark.parametrize("flag", ["--slurm", "--k8s"])
def test_cli_grace_comes_from_the_persist_time(capsys, flag):
    argv = ["plan", "gpt2", "--gpus", "8", "--persist-s", "100", "--stall-s", "2", flag, "-"]
    argv.append("--json")
    assert main(argv) == 0
    script = json.loads(capsys.readouterr().out)["script"]
    if flag == "--slurm":
        assert "#SBATCH --signal=B:USR1@200" in script
    else:
        pod = _k8s(script)["Job"]["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 200


def test_cli_writes_the_script_alone_to_a_file(tmp_path, capsys):
    """Issue #38: `gpumem plan ... --slurm > job.sbatch` mixed the report into the script."""
    path = tmp_path / "job.sbatch"
    assert main(["plan", "gpt2", "--gpus", "8", "--slurm", str(path)]) == 0
    out, err = capsys.readouterr()
    script = path.read_text()
    assert script.startswith("#!/bin/bash\n") and "best layout" not in script
    assert "best layout" in out and "#SBATCH" not in out and str(path) in err
    _bash_n(tmp_path, script)


def test_cli_script_alone_on_stdout(tmp_path, capsys):
    assert main(["plan", "gpt2", "--gpus", "8", "--slurm", "-"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash\n") and "best layout" not in out
    assert "best layout" in err
    _bash_n(tmp_path, out)


def test_cli_k8s_file_is_the_yaml_alone(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    assert main(["plan", "gpt2", "--gpus", "8", "--k8s", str(path)]) == 0
    assert list(_k8s(path.read_text())) == ["PriorityClass", "Service", "Job"]
    assert "best layout" in capsys.readouterr().out


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"partition": "spot nodes"}, "partition 'spot nodes' is not a Slurm name"),
        ({"job_name": "a;b"}, "job name 'a;b' is not a Slurm name"),
        ({"signal_s": -5}, r"signal_s \(the --signal lead, -5\)"),
        ({"signal_s": 60, "final_save_s": 90}, r"--signal lead \(60 s\) is shorter than"),
        ({"grace_time_s": -1}, "GraceTime"),
        ({"final_save_s": float("nan")}, "final_save_s"),
        ({"launcher": "mpirun"}, "launcher must be one of srun, torchrun"),
    ],
)
def test_sbatch_refuses_what_it_cannot_honour_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        sbatch_header(n_gpus=8, **kw)
    assert "\n" not in str(e.value)


def test_sbatch_warns_in_the_header_when_the_site_window_is_short(tmp_path):
    """GraceTime and torchrun's shutdown are the site's and torchrun's: a warning naming the
    setting, in the header comment, not an error."""
    s = sbatch_header(n_gpus=8, signal_s=120, final_save_s=40, grace_time_s=30, launcher="torchrun")
    warnings = [line for line in s.splitlines() if line.startswith("# WARNING")]
    assert len(warnings) == 2
    assert "the partition's GraceTime (30 s)" in warnings[0] and "(40 s)" in warnings[0]
    assert "torchrun's shutdown timeout (30 s)" in warnings[1]
    assert s.index("# WARNING") < s.index("set -uo pipefail")
    _bash_n(tmp_path, s)
    fits = sbatch_header(n_gpus=8, signal_s=120, final_save_s=20, grace_time_s=30)
    assert "WARNING" not in fits


def test_k8s_warns_when_the_grace_period_is_shorter_than_the_final_save():
    text = k8s_job(n_gpus=8, grace_s=60, final_save_s=90, notice_s=30)
    head = [line for line in text.splitlines() if line.startswith("# WARNING")]
    assert "terminationGracePeriodSeconds (60 s)" in head[0] and "(90 s)" in head[0]
    assert "GKE's grace on spot nodes (15 s)" in head[1]
    assert "torchrun's shutdown timeout (30 s)" in head[2]
    assert "the node's notice (30 s)" in head[3]
    _k8s(text)
    assert "WARNING" not in k8s_job(n_gpus=8, grace_s=60, final_save_s=10)
    assert "caps terminationGracePeriodSeconds" in k8s_job(n_gpus=8, final_save_s=10, notice_s=15)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"name": "my job"}, "job name 'my job' is not a Kubernetes name"),
        ({"priority_class": "Low"}, "priority class 'Low' is not a Kubernetes name"),
        ({"grace_s": -5}, r"grace_s \(terminationGracePeriodSeconds\) must be > 0"),
        ({"notice_s": -1}, r"notice_s \(the node's notice\)"),
        ({"final_save_s": float("inf")}, "final_save_s"),
        ({"priority": 2 * 10**9}, "priority must be in -2147483648..1000000000"),
    ],
)
def test_k8s_refuses_what_it_cannot_honour_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        k8s_job(n_gpus=8, **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag", ["--slurm", "--k8s", "--skypilot"])
def test_cli_a_model_where_the_file_goes_is_one_line(capsys, flag, tmp_path, monkeypatch):
    """`gpumem plan --slurm gpt2` read gpt2 as the FILE (it was optional) and then asked for a
    model: now the FILE is required and a model's name in its place is named as such."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", flag, "gpt2", "--gpus", "8"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"argument {flag}: 'gpt2' is a model, not the job script's FILE" in err
    assert f"gpumem plan gpt2 {flag} job" in err and list(tmp_path.iterdir()) == []


def test_cli_notice_reaches_every_script(capsys):
    """--notice: the partition's GraceTime for Slurm, the node's notice for Kubernetes and
    SkyPilot; a final save (here 100 s persist: the grace is 200 s) longer than it is a warning
    naming the setting."""
    base = ["plan", "gpt2", "--gpus", "8", "--persist-s", "100", "--stall-s", "2"]
    # gpt2's final save is well under a second: 0.5 s of notice is shorter
    for flag, setting in (
        ("--slurm", "the partition's GraceTime (0.5 s)"),
        ("--k8s", "the node's notice (0.5 s)"),
        ("--skypilot", "the spot notice (0.5 s)"),
    ):
        assert main([*base, "--notice", "0.5", flag, "-"]) == 0
        script = capsys.readouterr().out
        warnings = [line for line in script.splitlines() if line.startswith("# WARNING")]
        assert any(setting in w for w in warnings), (flag, warnings)


def test_without_pyyaml_the_yaml_outputs_say_what_to_install(monkeypatch):
    """gpumem does not require PyYAML: the Slurm script needs none, the others say so."""
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    assert sbatch_header(n_gpus=8).startswith("#!/bin/bash")
    with pytest.raises(ValueError, match="needs PyYAML: pip install pyyaml") as e:
        k8s_job(n_gpus=8)
    assert "\n" not in str(e.value)


def test_each_script_tells_the_guard_its_deadline(monkeypatch):
    """The guard cannot see GraceTime, the pod's grace or the spot notice: each script sets the
    shorter stop window in the guard's environment variable, and the real guard reads it."""
    from gpumem import PreemptionGuard
    from gpumem.planner import skypilot_task

    slurm = sbatch_header(n_gpus=8, signal_s=120, grace_time_s=30)
    ((name, value),) = re.findall(r"^export (\w+)=(\S+)", slurm, re.M)
    job = _k8s(k8s_job(n_gpus=8, final_save_s=10, notice_s=15))["Job"]
    (env,) = job["spec"]["template"]["spec"]["containers"][0]["env"]
    sky = yaml.safe_load(skypilot_task(n_gpus=8, accelerator="H100", notice_s=30))["envs"]
    cases = [
        ((name, value), 30.0),  # GraceTime 30 s < the --signal lead 120 s
        ((env["name"], env["value"]), 15.0),  # the notice 15 s < the pod's grace 60 s
        (next((k, v) for k, v in sky.items() if k.startswith("GPUMEM")), 30.0),
    ]
    for (var, text), expected in cases:
        monkeypatch.setenv(var, text)
        with PreemptionGuard(object()) as guard:
            assert guard.grace_s == expected, (var, text)
