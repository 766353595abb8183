"""measure_checkpoint with the real Checkpointer on a temporary directory (CPU): what it records,
that it cleans up, and the synthetic state it saves. Times are only checked to be positive and
finite; the fits are checked to be the fits of the recorded medians."""

import math
import statistics

import pytest

from gpumem.calibrate import (
    CalibrationError,
    default_sizes,
    fit_cost,
    measure_checkpoint,
    synthetic_state,
)
from gpumem.calibrate.checkpoint_cost import (
    QUANTITIES,
    filesystem_type,
    measure_points,
    split_elements,
)

MiB, GiB = 2**20, 2**30
SIZES = (2 * MiB, 6 * MiB)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return root, measure_checkpoint(root, SIZES, repeat=2, warmup=0, tensors=24)


def test_points_hold_every_repeat(measured):
    root, cost = measured
    assert (cost.device, cost.repeat, cost.directory) == ("cpu", 2, str(root.resolve()))
    assert [p.target_bytes for p in cost.points] == list(SIZES)
    for p in cost.points:
        assert (p.blocking_mode, p.overlap_mode) == ("blocking", "overlap")
        assert (
            p.tensors == 24 * 3 + 24
        )  # parameters, exp_avg, exp_avg_sq, and AdamW's step counters
        # staged bytes: the state, 4 B per step counter, and RNG states (a few KiB)
        assert p.target_bytes + 24 * 4 < p.nbytes < p.target_bytes + 64 * 1024
        for q in QUANTITIES:
            assert len(p.samples[q]) == 2
            assert all(math.isfinite(s) and s > 0 for s in p.samples[q])
        # an order of events, not a speed: the commit comes after the copy that training waited for
        assert all(
            d > s for d, s in zip(p.samples["durable_s"], p.samples["overlap_stall_s"], strict=True)
        )


def test_fits_are_the_fits_of_the_medians(measured):
    _, cost = measured
    xs = [p.nbytes for p in cost.points]
    for q in QUANTITIES:
        ys = [statistics.median(p.samples[q]) for p in cost.points]
        assert cost.fits[q] == fit_cost(xs, ys)
        assert cost.predict(xs[0])[q] == cost.fits[q].predict(xs[0])


def test_extrapolation_factor_is_over_the_largest_size_measured(measured):
    _, cost = measured
    top = cost.points[-1].nbytes
    assert cost.largest_bytes == top and cost.extrapolation_factor(4 * top) == 4.0


@pytest.mark.parametrize(
    "avail, disk, top",
    [
        (64 * GiB, 1 << 50, 2 * GiB),  # a GPU node: the 2 GiB cap
        (23 * GiB, 1 << 50, GiB),  # this kind of VM: 23 GiB / 16 -> 1 GiB
        (8 * GiB, 1 << 50, 512 * MiB),
        (GiB // 2, 1 << 50, 64 * MiB),  # never below 64 MiB: _check_room says what does not fit
        (64 * GiB, 6 * GiB, 1 * GiB),  # 4 x 1.3125 GiB of checkpoints fit 6 GiB, 2 GiB's do not
    ],
)
def test_default_sizes_reach_the_bandwidth_within_memory_and_disk(
    tmp_path, monkeypatch, avail, disk, top
):
    import shutil

    import gpumem.device

    monkeypatch.setattr(gpumem.device, "host_available_bytes", lambda: avail)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(disk, 0, disk))
    assert default_sizes(tmp_path) == [top // 16, top // 4, top]


def test_measure_checkpoint_without_sizes_uses_the_defaults(tmp_path, monkeypatch):
    import gpumem.calibrate.checkpoint_cost as cc

    monkeypatch.setattr(cc, "default_sizes", lambda d: [2 * MiB, 4 * MiB, 8 * MiB])
    cost = measure_checkpoint(tmp_path, repeat=1, warmup=0, tensors=6, drop_cache=False)
    assert [p.target_bytes for p in cost.points] == [2 * MiB, 4 * MiB, 8 * MiB]


def test_one_state_is_measured_alone_to_check_a_prediction(tmp_path):
    (p,) = measure_points(tmp_path, [3 * MiB], repeat=1, warmup=0, tensors=6, drop_cache=False)
    assert p.target_bytes == 3 * MiB and all(len(p.samples[q]) == 1 for q in QUANTITIES)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CalibrationError, match="give 1 to 64 different sizes"):
        measure_points(tmp_path, [])


def test_temporary_directory_is_removed(measured):
    root, _ = measured
    assert list(root.iterdir()) == []


def test_filesystem_type_is_known_here(measured):
    root, cost = measured
    assert cost.filesystem == filesystem_type(root)
    with open("/proc/self/mountinfo") as f:
        types = {line.split(" - ")[1].split()[0] for line in f if " - " in line}
    assert cost.filesystem in types


def test_temporary_directory_removed_on_error(tmp_path, monkeypatch):
    from gpumem.checkpoint import Checkpointer

    def broken(self, *args, **kwargs):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(Checkpointer, "save", broken)
    with pytest.raises(OSError, match="simulated"):
        measure_checkpoint(tmp_path, SIZES, repeat=1, warmup=0, tensors=6)
    assert list(tmp_path.iterdir()) == []


def test_streaming_is_recorded(tmp_path):
    # a staging cap below the state makes every save stream; the point says so
    cost = measure_checkpoint(
        tmp_path,
        (3 * MiB, 5 * MiB),
        repeat=1,
        warmup=0,
        tensors=6,
        staging_bytes=2 * MiB,
        drop_cache=False,
    )
    assert [(p.blocking_mode, p.overlap_mode) for p in cost.points] == [
        ("streaming", "streaming")
    ] * 2


def test_synthetic_state_has_the_size_asked_for():
    model, opt = synthetic_state(6 * MiB, tensors=30)
    params = list(model.parameters())
    assert len(params) == 30
    n = sum(p.numel() for p in params)
    assert n == 6 * MiB // 12
    state = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert sum(t.numel() * t.element_size() for t in state) == 8 * n  # exp_avg + exp_avg_sq
    assert all(p.grad is None for p in params)
    assert all(
        bool(s["exp_avg"].abs().sum() > 0) for s in opt.state.values()
    )  # real values, not zero pages


@pytest.mark.parametrize("elements, tensors", [(1000, 1), (1000, 3), (524_288, 96), (97, 96)])
def test_split_elements(elements, tensors):
    sizes = split_elements(elements, tensors)
    assert len(sizes) == tensors and sum(sizes) == elements and min(sizes) >= 1
    big = sizes[: tensors - tensors // 3]
    assert max(big) - min(big) <= 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sizes": (2 * MiB,)}, "give 2 to 64 different sizes"),
        ({"sizes": (2 * MiB, 2 * MiB)}, "give 2 to 64 different sizes"),
        ({"sizes": (1024, 2 * MiB)}, "below"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"repeat": 0}, "repeat=0"),
        ({"repeat": True}, "repeat=True"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    args = {"sizes": SIZES} | kwargs
    with pytest.raises(CalibrationError, match=match):
        measure_checkpoint(tmp_path, **args)


def test_missing_directory(tmp_path):
    with pytest.raises(CalibrationError, match="is not a directory"):
        measure_checkpoint(tmp_path / "nope", SIZES)
