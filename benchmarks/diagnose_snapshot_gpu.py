"""Where one CUDA snapshot's time goes: the timeline of a save with the Checkpointer's defaults.

On the state of ``bench_checkpoint.py --device cuda`` (GPT-like, fp32, AdamW), a
``gpumem.Checkpointer`` with its default settings (chunk_bytes, segment_bytes, staging) takes two
warm-up saves (arena allocation and pinning, kernel compilation, the copy/CRC programs), then for
``--repeat`` saves prints, per save:

- the host side: how long save() took, and of that how long the native enqueue of every copy
  and the CRC launch took (Python no longer works per tensor: if this approaches the device
  time, the host is still the limit);
- the device side (CUDA events on the snapshot's streams): the copies and the CRCs, from the
  common start (they run side by side: the copies never wait for the CRCs);
- in overlap mode, with a forward/backward beside the copy: the host wait in the optimizer hook
  and the time the compute stream stood still at the fence;
- the pinned-copy ceiling (one ``pinned.copy_(gpu, non_blocking=True)`` of the same bytes).

It prints a Markdown table; nothing is asserted (benchmarks/gpu_session.sh runs it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import make_state

import gpumem
import gpumem.checkpoint.stage.host_copy as host_copy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 30, help="state size (default 1 GiB)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diagnose_snapshot_gpu: needs a CUDA GPU; none here, nothing measured.")
        return 0
    model, opt, tensors = make_state(args.bytes, device="cuda")
    total = sum(t.numel() * t.element_size() for t in tensors)
    enqueue_s: list[float] = []
    real_enqueue = host_copy.enqueue

    def timed_enqueue(*a, **kw):
        t0 = time.perf_counter()
        try:
            return real_enqueue(*a, **kw)
        finally:
            enqueue_s.append(time.perf_counter() - t0)

    host_copy.enqueue = timed_enqueue
    src = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    ceiling = []
    for _ in range(args.repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinned.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        ceiling.append(time.perf_counter() - t0)
    del src, pinned
    x = torch.randn(8192, model.blocks[0]["qkv"].in_features, device="cuda")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpumem-diag-") as d:
        ck = gpumem.Checkpointer(d, keep=1)
        print(
            f"state {total / 2**20:.1f} MiB in {len(tensors)} tensors; Checkpointer defaults: "
            f"chunk_bytes={ck.config.chunk_bytes}, segment_bytes={ck.config.segment_bytes}, "
            f"staging_bytes={ck.staging_bytes}",
            flush=True,
        )
        for step in range(2):
            ck.save(step, model=model, optimizer=opt, rng=False, blocking=True)
            ck.wait()
        for i in range(args.repeat):
            for mode in ("blocking", "overlap"):
                enqueue_s.clear()
                torch.cuda.synchronize()
                st = ck.save(
                    10 + 2 * i + (mode == "overlap"),
                    model=model,
                    optimizer=opt,
                    rng=False,
                    blocking=mode == "blocking",
                )
                if mode == "overlap":
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    opt.step()  # the hook fences the stream behind the copy
                    opt.zero_grad(set_to_none=False)
                torch.cuda.synchronize()
                ck.wait()
                rows.append(
                    (
                        mode,
                        st.save_s,
                        sum(enqueue_s),
                        st.copy_device_s,
                        st.crc_device_s,
                        st.d2h_s,
                        st.hook_wait_s,
                        st.fence_s,
                    )
                )
        ck.close()
    print(f"pinned-copy ceiling: {statistics.median(ceiling[1:]) * 1e3:.2f} ms")
    print(
        "| mode | save() | host enqueue (copies + CRC launch) | device copies | device CRCs "
        "| D2H phase (host) | hook wait (host) | fence (stream) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, *t in rows:
        print(f"| {mode} | " + " | ".join(f"{v * 1e3:.2f} ms" for v in t) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
