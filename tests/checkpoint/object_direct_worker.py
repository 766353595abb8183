"""The killed uploader of test_object_direct.py.

python object_direct_worker.py URL ENDPOINT
    saves step 1 to the s3:// root (committed), prints "ready", reads a line from stdin (the test
    makes the store hang on every part meanwhile), then saves step 2, whose upload the test's
    SIGKILL cuts off.
"""

import sys

import torch

import gpumem


def main(url: str, endpoint: str) -> int:
    ck = gpumem.Checkpointer(url, endpoint_url=endpoint, staging_bytes=64 << 20, overlap=False)
    ck._root.objects.part_bytes = 5 << 20  # several parts per data file
    for step in (1, 2):
        torch.manual_seed(step)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1536), torch.nn.Linear(1536, 8))
        stats = ck.save(step, model=model, blocking=True)
        if step == 1:
            ck.wait()
            assert stats.committed
            print("ready", flush=True)
            sys.stdin.readline()
    ck.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
