"""A save into node-local directories: every node's temporary directory made whole before it
commits.

Collective, on every rank, after every rank wrote its shard (``commit.Commit``):

1. the shard manifests are all-gathered (they are small), and each node's leader writes the
   ones its node lacks: every node then holds every shard manifest, so a restore on the same
   ranks reads its own node's files only;
2. with ``replicas=k`` each rank sends its data files to its holders on the next k-1 nodes
   (``Nodes.holders``, ``peer_files``), which keep them in their node's temporary directory,
   on its local disk, under the same names;
3. the ranks agree that every file arrived (a failure anywhere commits nothing anywhere);
4. rank 0's main manifest bytes are broadcast, so that every node commits the same manifest
   (the same CRC32C), which each leader then writes and renames into place.

A node commits only once every node holds its part; a crash between two nodes' renames leaves
the step committed on some nodes only, which the restore (``restore.peers``) takes only when
the nodes it reaches hold every rank's files.
"""

from __future__ import annotations

import torch

from ...errors import CheckpointIOError
from ...group import Group, peers_gone, torch_distributed
from ..format import MAX_MANIFEST_BYTES, Manifest, encode_manifest
from ..format import shard_manifest_name as manifest_name
from ..safe_fs import Dir
from . import peer_files
from .topology import Nodes


def spread(
    nodes: Nodes, group: Group, tmp: Dir, files: list[str], main: Manifest | None
) -> tuple[bytes, int]:
    """Steps 1-4 above on this rank: (the main manifest's bytes, its CRC32C) for its leader to
    write. ``files``: this rank's data files in ``tmp``; ``main``: rank 0's manifest (None on
    the others).

    Raises:
        CheckpointIOError: on every rank, when any rank failed to send or keep a file.
    """
    g = group
    failure: BaseException | None = None
    try:
        own = tmp.read_small(manifest_name(g.rank), MAX_MANIFEST_BYTES, "manifest")
    except Exception as exc:  # still joins the collectives below
        own, failure = b"", exc
    sizes = [row[0] for row in g.all_gather([len(own)])]
    manifests = g.all_gather_bytes(own, sizes)
    if nodes.leads and failure is None:
        try:
            for r, data in enumerate(manifests):
                if nodes.node_of(r) != nodes.node and data:
                    tmp.write_new(manifest_name(r), data)
        except OSError as exc:
            failure = exc
    transfers = [
        peer_files.Transfer(r, holder, [])
        for r in range(g.world_size)
        for holder in nodes.holders(r)
    ]
    for t in transfers:
        if t.src == g.rank:
            t.names = list(files)
    err = peer_files.run(
        g,
        transfers,
        source=lambda t: tmp,
        target=lambda t: tmp,
        allowed=lambda t, name: name.startswith(f"data-r{t.src:05d}-") and "/" not in name,
    )
    failure = failure or err
    failed = [r for r, (ok,) in enumerate(g.all_gather([int(failure is None)])) if not ok]
    if failed:
        why = f": {failure}" if failure is not None else ""
        raise CheckpointIOError(
            f"rank(s) {failed} could not write the node-local copies (shard manifests, "
            f"replicas={nodes.replicas}){why}; nothing was committed on any node"
        )
    return broadcast_manifest(g, main)


def broadcast_manifest(g: Group, main: Manifest | None) -> tuple[bytes, int]:
    """Rank 0's encoded ``main`` (and CRC32C) on every rank."""
    data, crc = encode_manifest(main.body, main.version) if main is not None else (b"", 0)
    dist = torch_distributed()
    head = torch.tensor([len(data), crc], dtype=torch.int64)
    with peers_gone():
        dist.broadcast(head, src=0, group=g.pg)
        buf = torch.empty(int(head[0]), dtype=torch.uint8)
        if g.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src=0, group=g.pg)
    return buf.numpy().tobytes(), int(head[1])
