"""The GPU catalog: memory in bytes, stated unit explicit, and the reserve a job cannot use.

Vendors write "80GB" on an H100 whose HBM3 is 80 GiB (five 16 GiB stacks), and the driver then
reports a little less (81559 MiB). We store the vendor's statement with its unit made explicit
(``stated`` and ``stated_bytes``) and plan with what the driver reports as total
(``total_bytes``), from which a job still loses a reserve:

* CUDA context + library handles and workspaces (cuBLAS/cuDNN): ``context_bytes``, default
  600 MiB — sources put it at 300 MiB–2 GiB; gpu_poor assumes 650 MB.
* NCCL communicator buffers when more than one GPU talks: ``nccl_bytes``, default 1 GiB (NCCL
  allocates per-channel, per-peer buffers outside PyTorch's allocator; invisible to it).
* Fragmentation of the caching allocator: ``fragmentation`` = 5 % of the allocated peak (the
  "reserve 5 %" rule from vllm-project/compressed-tensors PR #587).

These are documented defaults; ``gpumem calibrate`` measures the context bytes (and, from a CUDA
profile of the user's step, the fragmentation) per machine, and ``Calibration.apply_to(gpu)``
returns the GPU with them (``--calibration FILE`` in ``gpumem estimate`` / ``plan``).

Example:
    >>> gpu = find_gpu("h100-80gb")
    >>> gpu.total_bytes
    85520809984
    >>> gpu = find_gpu(memory="80GiB")        # a GPU not in the catalog
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from gpumem.units import parse_bytes

MiB, GiB, GB = 2**20, 2**30, 10**9

CONTEXT_BYTES = 600 * MiB
NCCL_BYTES = 1 * GiB
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class GPU:
    """One accelerator model (or a MIG slice of one).

    Attributes:
        name: catalog name, e.g. ``H100-80GB``.
        stated: the vendor's label, e.g. ``"80GB"``.
        stated_bytes: that label in bytes with its real unit (NVIDIA HBM "GB" are GiB).
        total_bytes: what the driver reports as total memory (nvidia-smi / cudaMemGetInfo).
        gpus_per_node: GPUs in the usual server (HGX: 8), for node counts and hybrid sharding.
        bf16_tflops: dense bf16 peak, for the planner's throughput proxy.
        intra_gbps / inter_gbps: per-GPU bandwidth in GB/s inside a node (NVLink) and across
            nodes (network), for the planner's communication term.
    """

    name: str
    stated: str
    stated_bytes: int
    total_bytes: int
    gpus_per_node: int = 8
    bf16_tflops: float = 0.0
    intra_gbps: float = 0.0
    inter_gbps: float = 50.0
    context_bytes: int = CONTEXT_BYTES
    nccl_bytes: int = NCCL_BYTES
    fragmentation: float = FRAGMENTATION
    note: str = ""

    def reserve_bytes(self, allocated: int, n_gpus: int) -> int:
        """Memory a job loses outside its tensors: context, NCCL (if >1 GPU), fragmentation."""
        nccl = self.nccl_bytes if n_gpus > 1 else 0
        return self.context_bytes + nccl + int(allocated * self.fragmentation)


def _g(name, stated, stated_bytes, total_mib, **kw) -> GPU:
    return GPU(
        name=name, stated=stated, stated_bytes=stated_bytes, total_bytes=total_mib * MiB, **kw
    )


# total_mib: the driver's "total" (nvidia-smi, MiB) where we know it; else the stated capacity.
CATALOG: dict[str, GPU] = {
    g.name.lower(): g
    for g in (
        _g(
            "H100-80GB",
            "80GB",
            80 * GiB,
            81559,
            bf16_tflops=989,
            intra_gbps=450,
            note="H100 SXM5, HBM3",
        ),
        _g(
            "H100-80GB-PCIE",
            "80GB",
            80 * GiB,
            81559,
            bf16_tflops=756,
            intra_gbps=64,
            note="H100 PCIe, HBM2e",
        ),
        _g(
            "H100-94GB-NVL",
            "94GB",
            94 * GiB,
            95830,
            bf16_tflops=835,
            intra_gbps=300,
            note="H100 NVL",
        ),
        _g(
            "H200-141GB",
            "141GB",
            141 * GiB,
            143771,
            bf16_tflops=989,
            intra_gbps=450,
            note="H200 SXM, HBM3e",
        ),
        _g(
            "B200-192GB",
            "192GB",
            192 * GiB,
            183359,
            bf16_tflops=2250,
            intra_gbps=900,
            note="B200 HGX; driver exposes ~179 GiB",
        ),
        _g(
            "A100-80GB",
            "80GB",
            80 * GiB,
            81920,
            bf16_tflops=312,
            intra_gbps=300,
            note="A100 SXM4 80GB",
        ),
        _g(
            "A100-40GB",
            "40GB",
            40 * GiB,
            40960,
            bf16_tflops=312,
            intra_gbps=300,
            note="A100 SXM4 40GB",
        ),
        _g(
            "L40S-48GB",
            "48GB",
            48 * GiB,
            46068,
            bf16_tflops=362,
            intra_gbps=32,
            note="GDDR6 with ECC",
        ),
        _g(
            "RTX-4090-24GB",
            "24GB",
            24 * GiB,
            24564,
            gpus_per_node=1,
            bf16_tflops=165,
            intra_gbps=32,
            note="GDDR6X",
        ),
        _g(
            "MI300X-192GB",
            "192GB",
            192 * GiB,
            196592,
            bf16_tflops=1307,
            intra_gbps=448,
            note="AMD; rocm-smi total",
        ),
        # MIG slices: the profile name states the size; the driver exposes slightly less.
        _g(
            "H100-1g.10gb",
            "10GB",
            10 * GiB,
            9856,
            gpus_per_node=7,
            bf16_tflops=989 / 7,
            note="MIG 1/7 of H100-80GB",
        ),
        _g(
            "H100-2g.20gb",
            "20GB",
            20 * GiB,
            19968,
            gpus_per_node=3,
            bf16_tflops=989 * 2 / 7,
            note="MIG 2/7",
        ),
        _g(
            "H100-3g.40gb",
            "40GB",
            40 * GiB,
            40192,
            gpus_per_node=2,
            bf16_tflops=989 * 3 / 7,
            note="MIG 3/7",
        ),
        _g(
            "H100-7g.80gb",
            "80GB",
            80 * GiB,
            80896,
            gpus_per_node=1,
            bf16_tflops=989,
            note="MIG full",
        ),
        _g(
            "A100-1g.10gb",
            "10GB",
            10 * GiB,
            9728,
            gpus_per_node=7,
            bf16_tflops=312 / 7,
            note="MIG 1/7 of A100-80GB",
        ),
        _g(
            "A100-3g.40gb",
            "40GB",
            40 * GiB,
            39936,
            gpus_per_node=2,
            bf16_tflops=312 * 3 / 7,
            note="MIG 3/7",
        ),
    )
}

_ALIASES = {
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-pcie": "h100-80gb-pcie",
    "h200": "h200-141gb",
    "b200": "b200-192gb",
    "a100": "a100-80gb",
    "l40s": "l40s-48gb",
    "rtx-4090": "rtx-4090-24gb",
    "4090": "rtx-4090-24gb",
    "mi300x": "mi300x-192gb",
    "h100-1g.10gb": "h100-1g.10gb",
}


def find_gpu(name: str | None = None, memory: str | int | None = None) -> GPU:
    """A catalog GPU by name (case-insensitive), or an ad-hoc one from a memory size.

    Args:
        name: catalog name such as ``H100-80GB``; also the base for ``memory`` if both are given.
        memory: total memory, ``"80GiB"``/``"141GB"``/int bytes, for a GPU not in the catalog.

    Raises:
        LookupError: unknown name, with the nearest catalog names and the ``--gpu-memory`` hint.
        ValueError: a malformed or non-positive memory size.
    """
    if memory is not None:
        total = parse_bytes(memory)
        if total <= 0:
            raise ValueError(f"GPU memory must be positive, got {memory!r}")
        base = find_gpu(name) if name else GPU("custom", str(memory), total, total)
        return GPU(
            **{
                **base.__dict__,
                "name": f"{base.name}({memory})",
                "total_bytes": total,
                "stated": str(memory),
                "stated_bytes": total,
            }
        )
    if not name:
        raise ValueError("give a GPU name (e.g. H100-80GB) or its memory (e.g. 80GiB)")
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
    near = difflib.get_close_matches(key, list(CATALOG), n=3, cutoff=0.4)
    names = ", ".join(g.name for g in CATALOG.values())
    hint = f"did you mean {', '.join(CATALOG[n].name for n in near)}? " if near else ""
    raise LookupError(
        f"unknown GPU {name!r}: {hint}known: {names}; for another GPU give its memory instead "
        "(--gpu-memory 80GiB, or gpu_memory='80GiB')"
    )
