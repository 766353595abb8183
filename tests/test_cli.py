"""The gpumem command: in-process main(argv), python -m gpumem, and the doctor report."""

import json
import subprocess
import sys

import pytest

from gpumem.cli import main


def test_no_command_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    assert "doctor" in capsys.readouterr().out


def test_doctor_without_measurement(capsys):
    assert main(["doctor", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "versions" in out and "torch" in out and "GPUs" in out


def test_doctor_json_measures_bandwidth(capsys, tmp_path):
    pytest.importorskip("gpumem._C")
    assert main(["doctor", "--json", "--size", "8MiB", "--dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    whats = [b["what"] for b in report["bandwidth"]]
    assert whats[:3] == ["memcpy (1 thread)", "crc32c (1 thread)", "crc32c (all threads)"]
    assert whats[3].startswith("write+fsync")
    assert all(b["nbytes"] == 8 << 20 and b["gb_per_s"] > 0 for b in report["bandwidth"])
    assert report["problems"] == []
    assert list(tmp_path.iterdir()) == []  # the probe cleans up after itself


def test_bad_size_is_a_clear_error(capsys):
    assert main(["doctor", "--size", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_python_dash_m_works():
    out = subprocess.run(
        [sys.executable, "-m", "gpumem", "doctor", "--no-measure"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("gpumem doctor")
