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


# a finder that makes the analysis half's libraries absent, as in a --no-deps checkpoint install
_ABSENT = """
import sys, importlib.abc
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('matplotlib', 'numba'):
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, _Absent())
"""


def test_a_checkpoint_save_and_restore_need_no_matplotlib_or_numba(tmp_path):
    pytest.importorskip("gpumem._C")
    code = _ABSENT + (
        "import json, torch, gpumem.checkpoint\n"
        "from gpumem.checkpoint import Checkpointer\n"
        "m = torch.nn.Linear(8, 4); opt = torch.optim.Adam(m.parameters())\n"
        "m(torch.randn(2, 8)).sum().backward(); opt.step()\n"
        f"with Checkpointer({str(tmp_path)!r}) as ck:\n"
        "    ck.save(1, model=m, optimizer=opt); ck.wait()\n"
        "n = torch.nn.Linear(8, 4); o2 = torch.optim.Adam(n.parameters())\n"
        f"with Checkpointer({str(tmp_path)!r}) as ck:\n"
        "    step = ck.restore(model=n, optimizer=o2)\n"
        "same = torch.equal(m.weight, n.weight)\n"
        "print(json.dumps({'step': step, 'same': same, "
        "'loaded': [x for x in ('matplotlib', 'numba') if x in sys.modules]}))"
    )
    assert _run(code) == {"step": 1, "same": True, "loaded": []}


def test_a_chart_without_matplotlib_says_what_to_install():
    res = _run(
        _ABSENT + "import json\nfrom gpumem._plots import pyplot\n"
        "try:\n    pyplot()\nexcept ModuleNotFoundError as e:\n    print(json.dumps(str(e)))"
    )
    assert res == "charts need matplotlib, which is not installed: pip install matplotlib"
