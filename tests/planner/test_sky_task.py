"""The SkyPilot task ``gpumem plan --skypilot`` writes, read by SkyPilot itself (the pinned
``skypilot`` package): ``sky.Task.from_yaml_config`` validates the task, its resources and its
storage mounts against SkyPilot's schemas and builds the task, offline. The capacity follows
the decision: spot alone, on-demand alone, or spot first with on-demand as the fallback."""

import copy
import json
import sys

import pytest
import yaml

from gpumem.cli import main
from gpumem.planner import skypilot_task
from gpumem.planner.sky_task import capacity_of_policy


@pytest.fixture(autouse=True)
def _sky_home(tmp_path_factory, monkeypatch):
    """SkyPilot keeps its state under ~/.sky from its import on: a HOME of the tests' own."""
    home = tmp_path_factory.getbasetemp() / "sky-home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(home))


@pytest.fixture(autouse=True)
def _keep_tracebacks():
    """SkyPilot validates inside ``print_exception_no_traceback``, which sets
    ``sys.tracebacklimit = 0`` and, when the validation raises, never puts it back: every later
    traceback of the session (``gpumem --debug``'s) would print as its last line alone."""
    had, old = hasattr(sys, "tracebacklimit"), getattr(sys, "tracebacklimit", None)
    yield
    if had:
        sys.tracebacklimit = old
    elif hasattr(sys, "tracebacklimit"):
        del sys.tracebacklimit


def _sky():
    import sky  # under the tests' HOME (_sky_home)

    return sky


def _task(text: str):
    config = yaml.safe_load(text)
    return config, _sky().Task.from_yaml_config(copy.deepcopy(config))  # it pops what it reads


def test_task_is_skypilots_with_the_fallback_recovery_and_bucket():
    config, task = _task(
        skypilot_task(n_gpus=16, accelerator="H100", bucket="my-ckpts", store="s3")
    )
    assert task.num_nodes == 2
    spots = [r.use_spot for r in task.resources]  # ordered: spot first
    assert spots == [True, False]
    assert all(r.accelerators == {"H100": 8} for r in task.resources)
    recovery = {"strategy": "FAILOVER", "max_restarts_on_errors": 3}
    assert config["resources"]["job_recovery"] == recovery
    assert all(r.job_recovery == recovery for r in task.resources)
    (mount,) = task.storage_mounts.items()
    assert mount[0] == "/checkpoints" and mount[1].name == "my-ckpts"
    assert mount[1].mode.value == "MOUNT"
    assert config["envs"]["CKPT_DIR"] == "/checkpoints"
    run = config["run"].splitlines()
    assert run[-1].startswith("exec torchrun --nnodes=${SKYPILOT_NUM_NODES} --nproc-per-node=8 ")
    assert run[-1].endswith(" --rdzv-endpoint=${HEAD_IP}:29500 train.py")


@pytest.mark.parametrize(
    "policy, spots",
    [("on-demand", [False]), ("spot", [True]), ("gpumem", [True, False]), (None, [True, False])],
)
def test_capacity_follows_the_decision(policy, spots):
    capacity = capacity_of_policy(policy)
    _, task = _task(skypilot_task(n_gpus=8, accelerator="A100-80GB", capacity=capacity))
    assert sorted(r.use_spot for r in task.resources) == sorted(spots)


@pytest.mark.parametrize(
    "path, value, match",
    [
        (("resources", "job_recovery", "max_restarts_on_errors"), -1, "job_recovery"),
        (("file_mounts", "/checkpoints", "mode"), "MOUNTED", "MOUNT"),
        (("resources", "use_spots"), True, "use_spots"),
        (("num_nodes",), "two", "num_nodes"),
    ],
)
def test_skypilot_rejects_a_broken_task(path, value, match):
    """The check can fail: SkyPilot refuses each of these edits of a generated task."""
    config = yaml.safe_load(skypilot_task(n_gpus=8, accelerator="H100"))
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    sky = _sky()
    with pytest.raises((sky.exceptions.InvalidSkyPilotConfigError, ValueError), match=match):
        sky.Task.from_yaml_config(config)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"capacity": "cheap"}, "capacity must be one of spot, on-demand, spot-then-on-demand"),
        ({"bucket": "My Bucket"}, "bucket 'My Bucket' is not a bucket name"),
        ({"store": "dropbox"}, "store must be one of"),
        ({"max_restarts_on_errors": -1}, "max_restarts_on_errors must be >= 0"),
        ({"notice_s": -30}, r"notice_s \(the spot notice\)"),
        ({"final_save_s": float("nan")}, "final_save_s"),
        ({"accelerator": "H100 SXM"}, "accelerator 'H100 SXM'"),
    ],
)
def test_refuses_what_it_cannot_honour_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        skypilot_task(**{"n_gpus": 8, "accelerator": "H100", **kw})
    assert "\n" not in str(e.value)


def test_a_save_longer_than_the_spot_notice_is_a_warning():
    text = skypilot_task(n_gpus=8, accelerator="H100", final_save_s=40, notice_s=30)
    (warning,) = [line for line in text.splitlines() if line.startswith("# WARNING")]
    assert "the spot notice (30 s)" in warning and "(40 s)" in warning
    _task(text)
    on_demand = skypilot_task(
        n_gpus=8, accelerator="H100", capacity="on-demand", final_save_s=40, notice_s=30
    )
    assert "WARNING" not in on_demand  # no spot: no notice to fit


def test_cli_takes_the_capacity_from_the_decision(tmp_path, capsys):
    """Spot at a third of the price, rarely preempted, a loose deadline: the decision runs on
    spot with on-demand behind it, and the task asks for spot first, on-demand second."""
    path = tmp_path / "task.yaml"
    argv = [
        "plan", "gpt2", "--gpus", "8", "--run-hours", "10", "--deadline", "40h",
        "--capacity", "spot,price=1,preemptions-per-day=1,outage-h=0.5,notice=aws",
        "--capacity", "on-demand,price=3", "--skypilot", str(path), "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    best = json.loads(capsys.readouterr().out)["decision"]["best"]
    config, task = _task(path.read_text())
    spots = [r.use_spot for r in task.resources]
    assert spots == {"on-demand": [False], "spot": [True]}.get(best["policy"], [True, False])
    assert f"the capacity decision: {best['policy']}" in path.read_text()
    assert config["resources"]["accelerators"] == "H100:8"  # gpumem's H100-80GB
