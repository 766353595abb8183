"""gpumem ckpt ls / verify / inspect, called in process."""

import json

import torch

import gpumem
from gpumem.cli import main


def _make(root):
    with gpumem.Checkpointer(root, keep=None) as ck:
        for step in (1, 2):
            ck.save(step, model=torch.nn.Linear(4, 3), extra={"epoch": step}, rng=False)


def test_ls_verify_inspect(tmp_path, capsys):
    _make(tmp_path)
    assert main(["ckpt", "ls", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["ok"], r["latest"]) for r in rows] == [(1, True, False), (2, True, True)]
    assert all(r["nbytes"] == (12 + 3) * 4 for r in rows)
    assert main(["ckpt", "ls", str(tmp_path)]) == 0
    assert "<- latest" in capsys.readouterr().out

    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 2

    assert main(["ckpt", "inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 2 and info["ranks"][0]["extra"] == {"epoch": 2}
    names = {t["name"]: t for t in info["ranks"][0]["tensor_list"]}
    assert names["model.weight"]["shape"] == [3, 4] and names["model.weight"]["dtype"] == "float32"
    assert info["versions"]["torch"] == torch.__version__
    assert main(["ckpt", "inspect", str(tmp_path / "step-000000001")]) == 0
    assert "model.bias" in capsys.readouterr().out


def test_verify_reports_corruption(tmp_path, capsys):
    _make(tmp_path)
    data = tmp_path / "step-000000002" / "data-r00000-0000.bin"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert (
        "OK       step-000000001" in out
        and "CORRUPT  step-000000002" in out
        and "model.weight" in out
    )
    assert main(["ckpt", "ls", str(tmp_path / "missing")]) == 2


def test_import_says_what_a_gpumem_directory_is(tmp_path, capsys):
    """``ckpt import`` given a gpumem checkpoint (its root or one step) says it is one, and given
    any other directory that it lacks DCP's ``.metadata``: one line each, exit 2."""
    _make(tmp_path / "g")
    (tmp_path / "empty").mkdir()
    for src in ("g", "g/step-000000002"):
        assert main(["ckpt", "import", str(tmp_path / src), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "is a gpumem checkpoint already" in err and err.count("\n") == 1, err
    assert main(["ckpt", "import", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is not a plain DCP directory: it has no .metadata" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
