"""A Kubernetes manifest for a chosen layout: a PriorityClass, a headless Service for torchrun's
rendezvous, and an indexed Job (one pod per node, gang-admitted by Kueue), wired for preemption
with a trainer that checkpoints on SIGTERM (``gpumem.PreemptionGuard``).

What happens at a stop. Preemption by a higher-priority pod, a node drain or a spot node's
shutdown all end the same way: the kubelet sends SIGTERM to the container's PID 1 and SIGKILL
``terminationGracePeriodSeconds`` later. PID 1 is :data:`ENTRYPOINT`, a POSIX shell that forwards
SIGTERM to torchrun (torchrun passes it to its workers; PID 1 with no handler would ignore it,
and a shell that is not PID 1's ``exec`` would not pass it on) and exits
``REQUEUE_EXIT_CODE`` when it was told to stop: the Job's ``podFailurePolicy`` ignores that code
and evictions (``DisruptionTarget``), so a stop recreates the pod instead of counting against
``backoffLimit``, and the new pod resumes from the newest durable step.

The grace period is :func:`gpumem.planner.schedulers.grace_seconds` of the final save (measured
with a calibration, else ``notice.final_save_seconds``' guess), and a node's notice caps it: GKE
gives pods on spot nodes 15 s whatever the Job asks (``GKE_SPOT_GRACE_S``). A final save longer
than a window is a ``# WARNING`` line at the top naming the setting.

Example:
    >>>     >>> text = k8s_job(n_gpus=16, gpus_per_node=8, final_save_s=40, layout="dp2/tp8/pp1")
    >>> [d["kind"] for d in yaml.safe_load_all(text)]
    ['PriorityClass', 'Service', 'Job']
"""

from __future__ import annotations

import re
import shlex

from gpumem._env import GRACE_S_VAR
from gpumem.planner.notice import NOTICE_S
from gpumem.planner.schedulers import (
    RDZV_PORT,
    REQUEUE_EXIT_CODE,
    TORCHRUN_SHUTDOWN_S,
    dump_yaml,
    grace_seconds,
    nodes_for,
    save_warnings,
    torchrun_argv,
)

GKE_SPOT_GRACE_S = int(NOTICE_S["gke"])  # GKE gives non-system pods on spot nodes 15 s
GKE_SPOT_CAP = "GKE's grace on spot nodes"
DEFAULT_PRIORITY = -10  # below the default 0: ordinary workloads preempt it, it preempts none

# PID 1 of the trainer's container, run as `sh -c ENTRYPOINT sh TRAINER-ARGV...`
ENTRYPOINT = f"""\
STOP=0
trap 'STOP=1; kill -TERM "$pid" 2>/dev/null' TERM
"$@" &
pid=$!
while :; do
  wait "$pid"; rc=$?
  kill -0 "$pid" 2>/dev/null || break  # a trap ended the wait early: wait for the trainer
done
if [ "$STOP" -eq 1 ]; then exit {REQUEUE_EXIT_CODE}; fi  # told to stop: recreate the pod
exit "$rc"
"""


def _dns_name(setting: str, value: str) -> str:
    """A Kubernetes object name (RFC 1123 label: the Service and pod hostnames use it)."""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", value):
        raise ValueError(
            f"{setting} {value!r} is not a Kubernetes name: lower-case letters, digits and '-', "
            "starting and ending with a letter or digit, at most 63 characters"
        )
    return value


def k8s_job(
    *,
    n_gpus: int,
    gpus_per_node: int = 8,
    final_save_s: float | None = None,
    grace_s: int | None = None,
    notice_s: float | None = None,
    name: str = "gpumem-train",
    image: str = "REPLACE_WITH_IMAGE",
    queue: str = "default",
    priority_class: str = "gpumem-preemptible",
    priority: int = DEFAULT_PRIORITY,
    layout: str = "",
    command: str = "train.py",
    exit_code: int = REQUEUE_EXIT_CODE,
) -> str:
    """The manifest as YAML: a PriorityClass, a headless Service and an indexed Job.

    Args:
        n_gpus / gpus_per_node: the job's GPUs; one pod per node runs torchrun over its GPUs.
        final_save_s: seconds from SIGTERM to a durable final save (measured, or
            ``notice.final_save_seconds``): the grace period is twice it, at least a minute.
        grace_s: ``terminationGracePeriodSeconds`` given outright instead.
        notice_s: the node's notice before it goes (a spot node's), which caps the grace.
        priority_class / priority: the PriorityClass the pods run at (``preemptionPolicy:
            Never``: the job waits rather than evicting anyone).
        command: the trainer script and its arguments, run by torchrun on each node.

    Raises:
        ValueError: a name Kubernetes refuses, a non-positive grace or notice, an exit code
            outside 1..255, a priority the API server refuses (one line each).
    """
    save_warnings(final_save_s, {})  # a final save that is no number of seconds: its error
    if grace_s is None:
        grace_s = grace_seconds(final_save_s or 0.0)
    if not (isinstance(grace_s, int) and grace_s > 0):
        raise ValueError(f"grace_s (terminationGracePeriodSeconds) must be > 0, got {grace_s}")
    if notice_s is not None and not notice_s > 0:
        raise ValueError(f"notice_s (the node's notice) must be > 0 seconds, got {notice_s}")
    if not 0 < exit_code < 256:
        raise ValueError(f"exit_code must be in 1..255, got {exit_code}")
    if not -(2**31) <= priority <= 10**9:  # above 1e9 is the system's (system-cluster-critical)
        raise ValueError(f"priority must be in -2147483648..1000000000, got {priority}")
    for setting, value in (("job name", name), ("priority class", priority_class)):
        _dns_name(setting, value)
    windows: dict[str, float] = {
        "terminationGracePeriodSeconds": grace_s,
        GKE_SPOT_CAP: GKE_SPOT_GRACE_S,
        "torchrun's shutdown timeout": TORCHRUN_SHUTDOWN_S,
    }
    if notice_s is not None:
        windows["the node's notice"] = notice_s
    head = [f"# {w}" for w in save_warnings(final_save_s, windows)]
    if notice_s is not None and notice_s < grace_s:
        head.append(
            f"# the node's notice ({notice_s:g} s) caps terminationGracePeriodSeconds "
            f"({grace_s} s) when a spot node goes"
        )
    nodes = nodes_for(n_gpus, gpus_per_node)
    per_node = min(n_gpus, gpus_per_node)
    docs = [
        _priority_class(priority_class, priority),
        _service(name),
        _job(
            name=name,
            image=image,
            queue=queue,
            priority_class=priority_class,
            layout=layout,
            nodes=nodes,
            per_node=per_node,
            grace_s=grace_s,
            exit_code=exit_code,
            guard_s=min(grace_s, notice_s) if notice_s is not None else grace_s,
            argv=torchrun_argv(
                nodes=nodes,
                per_node=per_node,
                endpoint=f"{name}-0.{name}:{RDZV_PORT}",
                command=shlex.split(command),
            ),
        ),
    ]
    about = [
        f"# layout: {layout or '(not given)'}",
        "# PID 1 forwards SIGTERM to torchrun and exits "
        f"{exit_code} when told to stop; podFailurePolicy",
        "# ignores that code and evictions, so a stop recreates the pod, which resumes from the",
        "# newest durable checkpoint. Drop the PriorityClass if the cluster has one: name it",
        "# instead (priority_class). Checked against the Kubernetes API's models; no cluster ran",
        "# it (docs/checkpoint.md, Schedulers).",
    ]
    body = dump_yaml(*docs)
    return "\n".join([*head, *about]) + "\n" + body


def _priority_class(name: str, value: int) -> dict:
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name},
        "value": value,
        "preemptionPolicy": "Never",
        "globalDefault": False,
        "description": "preemptible training that checkpoints on SIGTERM (gpumem)",
    }


def _service(name: str) -> dict:
    """Headless: ``NAME-0.NAME`` resolves to the first pod, torchrun's rendezvous host."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"batch.kubernetes.io/job-name": name},
            "ports": [{"name": "rendezvous", "port": RDZV_PORT}],
        },
    }


def _job(
    *,
    name: str,
    image: str,
    queue: str,
    priority_class: str,
    layout: str,
    nodes: int,
    per_node: int,
    grace_s: int,
    exit_code: int,
    argv: list[str],
    guard_s: float,
) -> dict:
    container = {
        "name": "trainer",
        "image": image,
        "command": ["/bin/sh", "-c", ENTRYPOINT, "sh"],
        "args": argv,
        # Kubernetes does not tell the container its grace: the guard's deadline (GPUMEM_GRACE_S)
        "env": [{"name": GRACE_S_VAR, "value": f"{guard_s:g}"}],
        "resources": {"limits": {"nvidia.com/gpu": str(per_node)}},
    }
    pod = {
        "restartPolicy": "Never",  # podFailurePolicy needs it
        "priorityClassName": priority_class,
        "terminationGracePeriodSeconds": grace_s,
        "subdomain": name,
        "containers": [container],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "labels": {"kueue.x-k8s.io/queue-name": queue},
            "annotations": {"gpumem/layout": layout},
        },
        "spec": {
            "suspend": True,  # Kueue unsuspends when all the pods can be admitted together
            "completionMode": "Indexed",
            "parallelism": nodes,
            "completions": nodes,
            "backoffLimit": 10,  # real failures; stops do not count (podFailurePolicy)
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "Ignore",
                        "onExitCodes": {
                            "containerName": "trainer",
                            "operator": "In",
                            "values": [exit_code],
                        },
                    },
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                ]
            },
            "template": {
                "metadata": {"annotations": {"kueue.x-k8s.io/pod-group-total-count": str(nodes)}},
                "spec": pod,
            },
        },
    }


__all__ = ["ENTRYPOINT", "GKE_SPOT_GRACE_S", "k8s_job"]
