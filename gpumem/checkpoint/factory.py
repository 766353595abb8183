"""Which storage a Checkpointer saves to and restores from, picked from its root and the
environment (the façade only holds what this returns):

- an ``s3://`` directory: the object store itself (``storage.s3.object_backend``), each rank
  writing its own files; a restore takes the newest step that verifies;
- a local directory: every rank shares it, or each node has its own
  (``storage.nodes.topology.detect`` tells which); on node-local directories a restore takes
  the newest step the nodes hold whole, fetching missing files from peers (``restore.peers``),
  else the newest step that verifies;
- ``remote=``: the tiers (``tiers``), the store behind the local directory, probed before that
  directory is created.
"""

from __future__ import annotations

from dataclasses import dataclass

from .group import Group
from .restore import peers
from .restore.candidates import NewestRestore, Restorer
from .settings import CheckpointerConfig
from .storage.backend import StorageRoot
from .storage.commit import CommitOptions
from .storage.nodes.topology import detect
from .storage.root import Root
from .tiers.remote import Tiers


@dataclass(frozen=True)
class Storage:
    """The opened storage of one Checkpointer.

    Attributes:
        root: what saves commit into and restores list (``storage.backend.StorageRoot``).
        options: what every commit shares (``storage.commit.CommitOptions``).
        tiers: the remote tier and its uploader (no-ops without ``remote=``).
        restore: how a restore picks and reads its checkpoint.
    """

    root: StorageRoot
    options: CommitOptions
    tiers: Tiers
    restore: Restorer


def open_storage(cfg: CheckpointerConfig, group: Group) -> Storage:
    """The storage of a Checkpointer with ``cfg`` (see the module docstring), opened on every
    rank; raises as ``Checkpointer`` documents."""
    tiers = Tiers.from_config(cfg, group)  # the remote is probed before the directory is created
    # a shared directory, or one node-local per node (storage.nodes); a store is shared
    nodes = detect(cfg.directory, group, cfg.replicas, not cfg.read_only and cfg.url is None)
    options = CommitOptions(cfg.directory, cfg.alignment, cfg.direct_io, group, cfg.keep, nodes)
    if cfg.url is not None:
        from .storage.s3.object_backend import ObjectBackend  # boto3: only for an s3:// root

        store = ObjectBackend(cfg.url, cfg.endpoint_url, group, read_only=cfg.read_only)
        return Storage(store, options, tiers, NewestRestore(store, cfg.directory))
    root = Root(
        cfg.directory,
        group,
        read_only=cfg.read_only,
        lock_timeout_s=cfg.lock_timeout_s,
        collective_timeout_s=cfg.collective_timeout_s,
        nodes=nodes,
    )
    tiers.attach(nodes, cfg.endpoint_url, root)  # node-local: uploads per rank
    run: Restorer
    if nodes.local:
        run = peers.Restore(nodes, root, cfg.directory)
    else:
        run = NewestRestore(root, cfg.directory)
    return Storage(root, options, tiers, run)
