"""calibration.json: round trip, and hostile or invalid files rejected with a CalibrationError
that names the field."""

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumem.calibrate import Calibration, CalibrationError, load
from gpumem.calibrate.calibration import MAX_FILE_BYTES


def test_round_trip_is_exact(valid, tmp_path):
    cal = Calibration.from_dict(valid)
    assert cal.to_dict() == valid  # nothing lost, nothing added
    path = cal.save(tmp_path / "calibration.json")
    again = load(path)
    assert again == cal and again.to_dict() == valid
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]  # no temporary left


def test_fields_are_read(valid):
    cal = Calibration.from_dict(valid)
    assert cal.machine.cpu_count == 16 and cal.machine.gpu == "NVIDIA H100 80GB HBM3"
    assert cal.checkpoint.fits["durable_s"].seconds_per_byte == 4e-9
    assert cal.checkpoint.points[1].samples["restore_s"] == (1.0 + 3e-9 * 2**28,) * 2
    assert cal.gpu_reserve.context_bytes == 512 << 20 and cal.report.fragmentation == 0.1


def test_optional_parts_may_be_null(valid):
    valid["gpu_reserve"] = valid["report"] = None
    cal = Calibration.from_dict(valid)
    assert cal.gpu_reserve is None and cal.report is None
    valid["checkpoint"] = None
    with pytest.raises(CalibrationError, match="holds no measurement"):
        Calibration.from_dict(valid)


def _set(d, path, value):
    *head, last = path
    for k in head:
        d = d[k]
    if value is _DELETE:
        del d[last]
    else:
        d[last] = value


_DELETE = object()


@pytest.mark.parametrize(
    "path, value, match",
    [
        (("format",), "gpumem-checkpoint", "not a gpumem calibration file"),
        (("schema_version",), 3, "schema_version: 3; this gpumem reads 1, 2"),
        (("schema_version",), True, "schema_version"),
        (("created_utc",), "yesterday", "created_utc: 'yesterday' is not a UTC time"),
        (("machine", "cpu_count"), 0, "machine.cpu_count: 0 is below 1"),
        (("machine", "cpu_count"), True, "machine.cpu_count: expected an integer, got a boolean"),
        (("machine", "memory_bytes"), 1.5, "machine.memory_bytes: expected an integer"),
        (("machine", "host"), _DELETE, "machine.host: missing"),
        (("versions", "torch"), 2, "versions.torch: expected a string"),
        (("checkpoint", "device"), "tpu", "checkpoint.device: 'tpu' is not one of cpu, cuda"),
        (
            ("checkpoint", "fits", "durable_s", "seconds_per_byte"),
            -1e-9,
            "checkpoint.fits.durable_s.seconds_per_byte: -1e-09 is below 0",
        ),
        (
            ("checkpoint", "fits", "restore_s", "intercept_s"),
            "1.0",
            "checkpoint.fits.restore_s.intercept_s: expected a number",
        ),
        (
            ("checkpoint", "fits", "restore_s", "max_bytes"),
            64 << 20,
            "max_bytes .* must exceed min_bytes",
        ),
        (
            ("checkpoint", "fits", "overlap_stall_s"),
            _DELETE,
            "checkpoint.fits.overlap_stall_s: missing",
        ),
        (
            ("checkpoint", "fits", "overlap_stall_s"),
            [],
            "checkpoint.fits.overlap_stall_s: expected a JSON object",
        ),
        (("checkpoint", "points"), {}, "checkpoint.points: expected a JSON array"),
        (
            ("checkpoint", "points", 1, "samples", "durable_s"),
            [],
            r"checkpoint.points\[1\].samples.durable_s: no samples",
        ),
        (
            ("checkpoint", "points", 0, "samples", "durable_s", 0),
            -0.5,
            r"checkpoint.points\[0\].samples.durable_s\[0\]",
        ),
        (
            ("checkpoint", "points", 0, "overlap_mode"),
            "lazy",
            r"checkpoint.points\[0\].overlap_mode",
        ),
        (("checkpoint", "points", 0, "secret"), 1, r"unknown field\(s\) 'secret'"),
        (("gpu_reserve", "context_bytes"), -1, "gpu_reserve.context_bytes: -1 is below 0"),
        (("gpu_reserve", "context_bytes"), 2**70, "implausibly large"),
        (("gpu_reserve", "notes"), [1], r"gpu_reserve.notes\[0\]: expected a string"),
        (("report", "fragmentation"), 1e9, "report.fragmentation: .* not plausible"),
        (("report", "world_size"), 0, "report.world_size: 0 is below 1"),
        (("extra",), {}, r"the file: unknown field\(s\) 'extra'"),
    ],
)
def test_invalid_field_is_named(valid, path, value, match):
    _set(valid, path, value)
    with pytest.raises(CalibrationError, match=match):
        Calibration.from_dict(valid)


def test_one_point_is_not_a_line(valid):
    valid["checkpoint"]["points"] = valid["checkpoint"]["points"][:1]
    with pytest.raises(CalibrationError, match="needs two sizes"):
        Calibration.from_dict(valid)


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"format": "gpumem-calibration", "format": "x"}', "duplicate key 'format'"),
        ('{"schema_version": NaN}', "NaN is not a number"),
        ('{"schema_version": Infinity}', "Infinity is not a number"),
        ("[1, 2]", "expected a JSON object at the top"),
        ("{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ],
)
def test_not_a_calibration(text, match):
    with pytest.raises(CalibrationError, match=match):
        Calibration.from_json(text)


def test_float_overflow_is_not_finite(valid):
    text = json.dumps(valid).replace('"intercept_s": 2.0', '"intercept_s": 1e999')
    with pytest.raises(
        CalibrationError, match=r"checkpoint.fits.durable_s.intercept_s: inf is not finite"
    ):
        Calibration.from_json(text)


def test_load_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(CalibrationError, match=f"{missing}: cannot read the calibration file"):
        load(missing)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(CalibrationError, match="more than a calibration file holds"):
        load(big)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 1}')
    with pytest.raises(CalibrationError, match=f"^{bad}: format: 1 is not"):
        load(bad)


def _leaves(d, prefix=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _leaves(v, (*prefix, i))
    yield prefix


_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_hostile_edits_raise_only_calibration_errors(valid, data):
    """Replace, delete or add any field with any JSON value: a valid result or a
    CalibrationError."""
    d = copy.deepcopy(valid)
    paths = [p for p in _leaves(d) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        try:
            if action == "replace":
                _set(d, path, data.draw(_JUNK))
            elif action == "delete":
                _set(d, path, _DELETE)
            else:
                _set(d, (*path[:-1], data.draw(st.text(min_size=1, max_size=8))), data.draw(_JUNK))
        except (KeyError, IndexError, TypeError):
            continue  # the path vanished under an earlier edit
    text = json.dumps(d, allow_nan=True)
    try:
        cal = Calibration.from_json(text)
    except CalibrationError:
        return
    assert Calibration.from_json(cal.to_json()) == cal  # what loads, saves and loads the same


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_calibration_errors(raw):
    with pytest.raises(CalibrationError):
        Calibration.from_json(raw)


def test_reading_a_calibration_imports_no_torch(valid, tmp_path):
    """plan and estimate load the file: that must not pull torch, numba or NVML in."""
    import subprocess
    import sys

    path = tmp_path / "c.json"
    path.write_text(json.dumps(valid))
    code = (
        "import sys, gpumem.calibrate as c; cal = c.load(sys.argv[1]); "
        "cal.checkpoint_times(1 << 30); print(sorted(m for m in "
        "('torch', 'numba', 'pynvml', 'triton') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
