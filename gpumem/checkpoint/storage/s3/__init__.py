"""The object-store backend: an ``s3://bucket/prefix`` root every rank saves to directly
(``Checkpointer("s3://...")``), and the remote tier the uploads go to (``remote=``).

Modules:
    object_store   an S3-protocol store (boto3): multipart from memory, conditional put, ranged read
    object_requests the client of a root and its request funnel: botocore's errors as gpumem's
    object_listing HEAD, small reads, listing, deletion, incomplete uploads
    object_multipart puts, conditional puts, multipart uploads from memory with CRC32Cs
    object_ranges  ranged reads into caller memory, pinned to one version, resumed mid-body
    object_deadline deadlines of requests and operations; the watchdog that cuts a late one off
    object_body    a request's bytes as views of caller memory: body, parts, CRC32C headers, budget
    object_files   one save's objects as a step directory: written from the arena, ranged reads
    object_root    checkpoints in an object store: a step uploaded, committed by conditional put
    object_upload  a committed local step uploaded: whole, or each rank its own files, then commit
    object_commit  ObjectCommit: Commit's protocol with a save's own objects and a conditional put
    object_backend an s3:// root as an open Checkpointer holds it; its steps as restore candidates
"""
