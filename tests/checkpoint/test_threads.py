"""The checkpoint tests' thread setting (conftest.py) reaches this process's native pool."""

import os
import subprocess
import sys

from conftest import NATIVE_THREADS

from gpumem._native import load
from gpumem.checksum import cpu_features

load()  # as in a full run, where some module's collection loads gpumem._C before any fixture


def test_native_pool_runs_with_the_conftest_thread_count():
    # gpumem._C was loaded while the tests were collected, so GPUMEM_THREADS set by a fixture
    # alone would leave the pool at its collection-time size (all cores, or an outer setting).
    assert os.environ["GPUMEM_THREADS"] == str(NATIVE_THREADS)
    assert cpu_features()["threads"] == NATIVE_THREADS


def test_child_processes_inherit_the_setting():
    code = "from gpumem.checksum import cpu_features; print(cpu_features()['threads'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(NATIVE_THREADS)
