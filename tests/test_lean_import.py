"""`import gpumem` stays lean: no torch, triton or numba, no CUDA context, until a feature needs
them."""

import json
import subprocess
import sys

import pytest


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


HEAVY = ("torch", "triton", "numba", "pynvml", "transformers", "lightning")
_LOADED = f"print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"


def test_import_gpumem_imports_no_heavy_module():
    assert _run("import sys, json, gpumem; " + _LOADED) == dict.fromkeys(HEAVY, False)


def test_the_integrations_package_imports_no_trainer():
    # it is reached as gpumem.integrations, and it names hf and lightning without importing them
    res = _run(
        "import sys, json, gpumem; gpumem.integrations; import gpumem.integrations; "
        "assert {'hf', 'lightning'} <= set(dir(gpumem.integrations)); " + _LOADED
    )
    assert res == dict.fromkeys(HEAVY, False)


def test_dcp_resolves_from_the_root():
    # the README's gpumem.dcp.StorageWriter, after a bare `import gpumem`
    res = _run(
        "import json, gpumem; w = gpumem.dcp.StorageWriter; "
        "print(json.dumps([w.__module__, w.__name__, 'dcp' in dir(gpumem)]))"
    )
    assert res == ["gpumem.checkpoint.interop.dcp_storage", "StorageWriter", True]


def test_integrations_resolve_from_the_root():
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    res = _run(
        "import json, gpumem; "
        "print(json.dumps([gpumem.integrations.hf.CheckpointCallback.__module__, "
        "gpumem.integrations.lightning.CheckpointCallback.__module__]))"
    )
    assert res == ["gpumem.integrations.hf", "gpumem.integrations.lightning"]


def test_all_names_every_lazy_name():
    # __all__ is a literal for type checkers and `import *`; it must match what resolves
    import gpumem

    lazy = set(gpumem._LAZY_ATTRS) | set(gpumem._LAZY_MODULES) | {"__version__"}
    assert len(gpumem.__all__) == len(set(gpumem.__all__))
    assert set(gpumem.__all__) == lazy


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
