"""A SkyPilot task for a chosen layout: the capacity the decision chose (spot, on-demand, or
spot with an on-demand fallback), managed-job recovery, a checkpoint bucket mounted on every node
and a run command that resumes from the newest durable step.

The task, field by field (SkyPilot's task YAML):

    resources.accelerators  the GPUs per node, as SkyPilot names them (``SKYPILOT_ACCELERATORS``)
    resources.use_spot      spot or on-demand, when the decision chose one of them alone
    resources.ordered       spot first, then on-demand: the fallback the decision's policies
                            (Uniform Progress, gpumem's) switch to. SkyPilot tries the list in
                            order at each launch and recovery; it does not run gpumem's policy
    resources.job_recovery  FAILOVER (retry where the job ran, then elsewhere) and
                            ``max_restarts_on_errors``: a stop on a node that stays up (the
                            trainer exits ``REQUEUE_EXIT_CODE``) counts as an error there
    file_mounts             the checkpoint bucket in MOUNT mode at ``CKPT_DIR``: a checkpoint
                            written there survives the cluster
    run                     ``exec torchrun ... COMMAND`` (exec: SIGTERM reaches torchrun, which
                            passes it to the workers); the trainer restores from ``$CKPT_DIR``
                            (``Checkpointer.restore`` takes the newest complete step)

Launch it with ``sky jobs launch task.yaml`` (managed jobs recover; ``sky launch`` does not).

Example:
    >>> import yaml
    >>> text = skypilot_task(n_gpus=16, accelerator="H100", capacity="spot-then-on-demand")
    >>> yaml.safe_load(text)["resources"]["ordered"]
    [{'use_spot': True}, {'use_spot': False}]
"""

from __future__ import annotations

import re
import shlex

from gpumem._env import GRACE_S_VAR
from gpumem.planner.schedulers import RDZV_PORT, dump_yaml, nodes_for, save_warnings, torchrun_argv

CAPACITIES = ("spot", "on-demand", "spot-then-on-demand")
STORES = ("s3", "gcs", "azure", "r2")
# gpumem's GPU catalog names (estimator/gpus.py) -> SkyPilot's accelerator names
SKYPILOT_ACCELERATORS = {
    "H100-80GB": "H100",
    "H100-80GB-PCIE": "H100",
    "H100-94GB-NVL": "H100-NVL",
    "H200-141GB": "H200",
    "B200-192GB": "B200",
    "A100-80GB": "A100-80GB",
    "A100-40GB": "A100",
    "L40S-48GB": "L40S",
    "RTX-4090-24GB": "RTX4090",
    "MI300X-192GB": "MI300X",
}
CKPT_DIR = "/checkpoints"


def capacity_of_policy(policy: str | None) -> str:
    """The SkyPilot capacity for a capacity decision's policy (None: no decision was made)."""
    if policy in ("on-demand", "spot"):
        return policy
    return "spot-then-on-demand"  # Uniform Progress, gpumem's, or no decision: spot first


def skypilot_task(
    *,
    n_gpus: int,
    accelerator: str,
    gpus_per_node: int = 8,
    capacity: str = "spot-then-on-demand",
    bucket: str = "gpumem-checkpoints",
    store: str | None = None,
    name: str = "gpumem-train",
    layout: str = "",
    command: str = "train.py",
    max_restarts_on_errors: int = 3,
    final_save_s: float | None = None,
    notice_s: float | None = None,
    why: str = "",
) -> str:
    """The task YAML (module doc: the fields).

    Args:
        accelerator: SkyPilot's name of the GPU (``SKYPILOT_ACCELERATORS`` maps gpumem's).
        capacity: one of ``CAPACITIES`` (:func:`capacity_of_policy` of a decision).
        bucket / store: the checkpoint bucket (created if missing) and its cloud (None:
            SkyPilot picks the task's cloud's).
        final_save_s / notice_s: the final save and the spot notice: a save longer than the
            notice is a ``# WARNING`` line naming it.
        why: one line on where the capacity came from, for the header.

    Raises:
        ValueError: an unknown capacity or store, a bucket name clouds refuse, a negative
            ``max_restarts_on_errors``, a notice <= 0 (one line each).
    """
    if capacity not in CAPACITIES:
        raise ValueError(f"capacity must be one of {', '.join(CAPACITIES)}, got {capacity!r}")
    if store is not None and store not in STORES:
        raise ValueError(f"store must be one of {', '.join(STORES)}, got {store!r}")
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]", bucket):
        raise ValueError(
            f"bucket {bucket!r} is not a bucket name: 3-63 lower-case letters, digits and '-'"
        )
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", accelerator):
        raise ValueError(f"accelerator {accelerator!r} is not a SkyPilot accelerator name")
    if max_restarts_on_errors < 0:
        raise ValueError(f"max_restarts_on_errors must be >= 0, got {max_restarts_on_errors}")
    if notice_s is not None and not notice_s > 0:
        raise ValueError(f"notice_s (the spot notice) must be > 0 seconds, got {notice_s}")
    nodes = nodes_for(n_gpus, gpus_per_node)
    per_node = min(n_gpus, gpus_per_node)
    resources: dict = {"accelerators": f"{accelerator}:{per_node}"}
    if capacity == "spot-then-on-demand":
        resources["ordered"] = [{"use_spot": True}, {"use_spot": False}]
    else:
        resources["use_spot"] = capacity == "spot"
    resources["job_recovery"] = {
        "strategy": "FAILOVER",
        "max_restarts_on_errors": max_restarts_on_errors,
    }
    mount: dict = {"name": bucket, "mode": "MOUNT"}
    if store is not None:
        mount["store"] = store
    launch = torchrun_argv(
        nodes="${SKYPILOT_NUM_NODES}",
        per_node=per_node,
        endpoint=f"${{HEAD_IP}}:{RDZV_PORT}",
        command=[],
    )
    task = {
        "name": name,
        "num_nodes": nodes,
        "resources": resources,
        # the guard's deadline (GPUMEM_GRACE_S): the spot notice, where one is known
        "envs": {"CKPT_DIR": CKPT_DIR, **({GRACE_S_VAR: f"{notice_s:g}"} if notice_s else {})},
        "file_mounts": {CKPT_DIR: mount},
        "run": 'HEAD_IP=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)\n'
        + "# exec: SIGTERM goes to torchrun itself; the trainer resumes from $CKPT_DIR\n"
        + f"exec {' '.join(launch)} {shlex.join(shlex.split(command))}\n",
    }
    spot = capacity != "on-demand"
    windows = {"the spot notice": notice_s} if notice_s is not None and spot else {}
    head = [
        *(f"# {w}" for w in save_warnings(final_save_s, windows)),
        f"# layout: {layout or '(not given)'}",
        f"# capacity: {capacity}{f' ({why})' if why else ''}",
        "# launch with `sky jobs launch` (managed: recovers from preemption). Checked against",
        "# SkyPilot's task schema; no cloud ran it (docs/checkpoint.md, Schedulers).",
    ]
    return "\n".join(head) + "\n" + dump_yaml(task)


__all__ = ["CAPACITIES", "SKYPILOT_ACCELERATORS", "capacity_of_policy", "skypilot_task"]
