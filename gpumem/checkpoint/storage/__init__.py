"""The storage: the on-disk format and how a save becomes durable and visible in a directory or
an object store.

Modules:
    backend    the seam: what a save and a restore ask of a root, in order (Protocols)
    step_reads the seam's read half: what a restore reads of one committed step (StepFiles)
    format     the format, reader and writer: manifests framed with CRC32C and version, validated
    tensor_table  a shard manifest's tensor table decoded natively (accept-only: Python decides)
    directory  the checkpoint directory: manifest files, the commit rename, latest, retention
    commit     Commit: one save's collectives, writes, manifests, commit and retention
    writes     one rank's data files from the snapshot, its host CRCs, its shard manifest
    agreement  what the ranks of a save must agree on, and the sharded save's block check
    root       the directory as an open Checkpointer holds it: opened, locked, agreed on, listed
    lock       one job per directory: the advisory lock rank 0 holds
    safe_fs    descriptor-relative, no-follow file access a hostile directory cannot redirect
    location   where a root is: a local directory, or a URL (refused, or an s3:// ObjectURL)
    s3         the object-store backend: the store, a root of checkpoints in it, direct saves
    nodes      the node-local backend: which ranks share a directory, replicas, peer transfers
"""
