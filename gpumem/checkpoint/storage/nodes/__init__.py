"""The node-local backend: one directory per node (node-local NVMe) instead of one every rank
shares, each step's files replicated to other nodes and sent between them over the gloo group.

Modules:
    topology   one shared directory or one per node (detected): nodes, leaders, replica holders
    replicas   a node-local save: manifests on every node, replicas sent, one main manifest
    peer_files checkpoint files sent between two ranks over the gloo group, CRC-checked
"""
