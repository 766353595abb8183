"""`import gpumem` stays lean: no torch, triton or numba, no CUDA context, until a feature needs
them."""

import json
import subprocess
import sys

import pytest


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_gpumem_imports_no_heavy_module():
    res = _run(
        "import sys, json, gpumem; "
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'triton', 'numba', 'pynvml')}))"
    )
    assert res == {"torch": False, "triton": False, "numba": False, "pynvml": False}


def test_public_names_resolve_lazily():
    res = _run(
        "import sys, json, gpumem; gpumem.units.parse_bytes if hasattr(gpumem, "
        "'units') else None; d = dir(gpumem); print(json.dumps({'dir': "
        "'checksum' in d, 'triton': 'triton' in sys.modules}))"
    )
    assert res == {"dir": True, "triton": False}


def test_cpu_checksum_does_not_import_triton_or_numba():
    pytest.importorskip("gpumem._C")
    res = _run(
        "import sys, json, gpumem; import torch; "
        "gpumem.checksum.crc32c(b'abc'); "
        "gpumem.checksum.chunk_crc32c(torch.zeros(10, dtype=torch.uint8), 4); "
        "print(json.dumps({m: m in sys.modules for m in ('triton', 'numba')} | "
        "{'cuda_init': torch.cuda.is_initialized()}))"
    )
    assert res == {"triton": False, "numba": False, "cuda_init": False}


def test_unknown_attribute_is_a_clear_error():
    import gpumem

    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        gpumem.nonexistent  # noqa: B018
