"""The upload tiers: a checkpoint durable on the local directory first, then copied to an
object store in the background (``Checkpointer(directory, remote="s3://bucket/prefix")``).

Modules:
    remote        Tiers: a local directory first, an s3:// remote uploaded in the background
    node_uploads  the tiers on node-local directories: each rank uploads its shards, rank 0 commits
    upload_thread the one uploader thread both run their uploads on
"""
