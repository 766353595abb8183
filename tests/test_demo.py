"""`gpumem demo --quick`, run as CI runs it: the four parts' results, the files it promises,
and the resumed loss curve bit-identical to the uninterrupted one. (Its time limits are checked
by running it, not here: a test asserts behaviour, not wall-clock time.)"""

import json
import struct

from gpumem.cli import main
from gpumem.demo import FULL, REQUEUE_EXIT_CODE, run_demo


def test_demo_quick(tmp_path):
    lines: list[str] = []
    result = run_demo(tmp_path / "demo", quick=True, echo=lines.append)
    text = "\n".join(lines)
    # 1: the profile table and its chart
    assert "gpumem profile of" in text and result.peak_bytes > 0
    assert result.profile_chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"chart: {result.profile_chart}" in text
    # 2: the 70B wall: 16 B/param x 68,976,648,192 parameters
    assert result.cluster_state_bytes == 16 * 68_976_648_192
    assert "1.10 TB of model state" in text and "does NOT fit" in text
    assert "dp8/tp8" in result.best_layout
    # 3: measured checkpoint times, priced; the 47-hour loss
    cal = json.loads(result.calibration.read_text())
    assert cal["format"] == "gpumem-calibration" and len(cal["checkpoint"]["points"]) == 2
    assert result.persist_s >= result.stall_s > 0 and result.interval_s >= result.persist_s
    assert "$9,024 lost without a checkpoint" in text
    assert "does not finish in expectation" in text
    # 4: SIGTERM mid-run, final checkpoint, restart, bit-identical resume
    assert result.preempted_exit_code == REQUEUE_EXIT_CODE
    assert result.resumed_from == 7
    assert len(result.losses) == len(result.reference) == 12
    assert result.bit_identical
    assert "12 of 12 losses have the same bits" in text
    assert struct.unpack(">I", result.loss_chart.read_bytes()[16:20])[0] > 0
    # only the demo's own files; the calibration's temporary directory is gone
    names = sorted(p.name for p in (tmp_path / "demo").iterdir())
    assert names == [
        "calibration.json",
        "ckpts-job",
        "ckpts-ref",
        "loss.png",
        "losses-job.txt",
        "losses-ref.txt",
        "profile.png",
    ]


def test_demo_out_must_be_a_directory(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["demo", "--quick", "--out", str(tmp_path / "f")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_the_full_demo_calibrates_at_gpumem_calibrates_defaults():
    # its old 16 and 64 MiB put a 28 GiB restore at 175 s where 1-2 GiB put it at 14 s
    assert FULL.calibrate_sizes is None
