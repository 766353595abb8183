"""The restore: a checkpoint read back, every byte verified, then loaded all or nothing.

Modules:
    candidates  restore(): newest first, one verdict on every rank, fallback to older steps
    verdict     the ranks' findings exchanged and unified: one error class and message for all
    plain       PlainRestore: one saved rank's tree read whole (DDP, single process, pipeline)
    into_live   the plain restore's reads into the staging arena, copied into the live tensors
    sharded     ShardedRestore: DTensor state resharded into the objects' layout on any world size
    reshard     GlobalIndex (saved blocks by global tensor) and Reader (chunk-aligned box reads)
    files       a shard's tensors read from its data files, CRCs checked as the bytes land
    validate    does a decoded tree fit the objects? checked before any is touched
    load        apply(): the tree loaded into the objects with rollback
    verify      verify(): a whole checkpoint directory checked without objects
    fetch       fetch(): an object-store root's newest good step copied locally and verified
    peers       node-local restore: the newest step held whole, missing or damaged files fetched
"""
