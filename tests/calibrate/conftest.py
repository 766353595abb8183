"""A calibration file written by hand (not by gpumem), so format tests do not trust the writer."""

import copy

import pytest

MiB, GiB = 2**20, 2**30

# hand-picked coefficients: seconds = a + b * bytes
COEFFS = {
    "blocking_stall_s": (0.25, 2e-9),
    "overlap_stall_s": (0.5, 1e-9),
    "durable_s": (2.0, 4e-9),
    "restore_s": (1.0, 3e-9),
}


def _fit(a: float, b: float) -> dict:
    return {
        "intercept_s": a,
        "seconds_per_byte": b,
        "n_points": 2,
        "min_bytes": 64 * MiB,
        "max_bytes": 256 * MiB,
        "rms_residual_s": 0.0,
    }


def _point(nbytes: int) -> dict:
    return {
        "target_bytes": nbytes,
        "nbytes": nbytes + 4096,
        "tensors": 384,
        "blocking_mode": "blocking",
        "overlap_mode": "overlap",
        "samples": {q: [a + b * nbytes, a + b * nbytes] for q, (a, b) in COEFFS.items()},
    }


VALID = {
    "format": "gpumem-calibration",
    "schema_version": 2,
    "created_utc": "2026-01-31T12:00:00Z",
    "machine": {
        "host": "node-7",
        "cpu": "Test CPU",
        "cpu_count": 16,
        "memory_bytes": 128 * GiB,
        "gpu": "NVIDIA H100 80GB HBM3",
    },
    "versions": {"python": "3.11.7", "torch": "2.13.0", "gpumem": "0.1.0"},
    "checkpoint": {
        "directory": "/ckpts",
        "filesystem": "xfs",
        "device": "cuda",
        "repeat": 2,
        "fits": {q: _fit(a, b) for q, (a, b) in COEFFS.items()},
        "points": [_point(64 * MiB), _point(256 * MiB)],
    },
    "gpu_reserve": {
        "device_name": "NVIDIA H100 80GB HBM3",
        "total_bytes": 81559 * MiB,
        "context_bytes": 512 * MiB,
        "context_source": "nvml process used - reserved",
        "reserved_bytes": 20 * MiB,
        "d2h_gb_per_s": 24.5,
        "h2d_gb_per_s": 25.1,
        "notes": [],
    },
    "report": {
        "device": "NVIDIA H100 80GB HBM3",
        "allocated_peak_bytes": 40 * GiB,
        "reserved_peak_bytes": 44 * GiB,
        "fragmentation_bytes": 4 * GiB,
        "fragmentation": 0.1,
        "outside_allocator_bytes": 900 * MiB,
        "outside_allocator_source": "nvml process used - reserved",
        "world_size": None,
    },
    "memory": None,
}


@pytest.fixture
def valid() -> dict:
    """A fresh deep copy of a valid calibration dict."""
    return copy.deepcopy(VALID)
