"""Which ranks share a checkpoint directory: one shared directory, or one node-local per node.

A multi-node job either writes into one directory every rank sees (NFS, Lustre: rank 0 creates
the step's temporary directory and commits it) or gives each node its own disk under the same
path (node-local NVMe). Which one is found, not configured: at construction every rank writes a
marker file into its directory and every rank reports which ranks' markers it sees. All see all:
shared. Otherwise each group of ranks that see each other's markers is one node's directory,
and its lowest rank (the node's *leader*) plays rank 0's part there: it locks the directory,
creates the step's temporary directory, writes the main manifest and renames the step into place.

Node identity, for placing replicas on other nodes (``replicas=``), comes from the launcher:
``GPUMEM_NODE`` if set (tests simulate nodes with it), else ``GROUP_RANK`` (torchrun's node
index), else ``rank // LOCAL_WORLD_SIZE``, else the host name, gathered over torch.distributed.
A node-local layout must match it: ranks of one node share one directory, two nodes do not.
"""

from __future__ import annotations

import contextlib
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from gpumem._env import env_int, env_str

from ...errors import CheckpointStateError
from ...group import Group

_PROBE = ".gpumem-probe-"


@dataclass(frozen=True)
class Nodes:
    """The job's nodes as the checkpoint sees them.

    Attributes:
        local: each node has its own directory (False: one directory every rank shares).
        nodes: the global ranks of each node, nodes ordered by their lowest rank.
        rank: this rank.
        replicas: copies of each rank's data files, on as many nodes (1: its own node only).
    """

    local: bool
    nodes: tuple[tuple[int, ...], ...]
    rank: int
    replicas: int = 1

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def leader(self, node: int | None = None) -> int:
        """The lowest rank of ``node`` (this rank's node by default): rank 0's part in its
        directory."""
        return self.nodes[self.node if node is None else node][0]

    @property
    def leads(self) -> bool:
        """This rank creates, commits and cleans its directory (rank 0 in a shared one)."""
        return self.rank == (self.leader() if self.local else 0)

    def holders(self, rank: int) -> list[int]:
        """The ranks that keep a replica of ``rank``'s data files (not ``rank`` itself): on each
        of the next ``replicas - 1`` nodes (in node order, wrapping), the rank at the same local
        index (modulo that node's size)."""
        n = self.node_of(rank)
        index = self.nodes[n].index(rank)
        out = []
        for j in range(1, self.replicas):
            other = self.nodes[(n + j) % len(self.nodes)]
            out.append(other[index % len(other)])
        return out


def single(rank: int = 0) -> Nodes:
    return Nodes(False, ((rank,),), rank)


def detect(directory: Path, group: Group, replicas: int, probe: bool = True) -> Nodes:
    """The layout of ``directory`` over the ranks of ``group`` (see the module docstring).

    ``probe=False`` (read_only: nothing may be written) takes the directory as shared.

    Raises:
        CheckpointStateError: ``replicas`` exceeds the nodes, replicas with a shared directory,
            or the directories seen do not match the launcher's nodes (naming the ranks).
    """
    g = group
    if g.world_size == 1:
        if replicas > 1:
            raise _too_many(replicas, 1, directory)
        return single()
    names = _node_names(g)
    by_name: dict[str, list[int]] = {}
    for r, name in enumerate(names):
        by_name.setdefault(name, []).append(r)
    nodes = tuple(sorted((tuple(rs) for rs in by_name.values()), key=lambda rs: rs[0]))
    everyone = set(range(g.world_size))
    seen = _probe(directory, g) if probe else [everyone] * g.world_size
    if all(ranks == everyone for ranks in seen):
        if replicas > 1:
            raise CheckpointStateError(
                f"replicas={replicas} with directory={directory}: every rank sees that "
                "directory (a shared file system), where one copy serves every node; replicas "
                "are for node-local directories: use replicas=1"
            )
        return Nodes(False, nodes, g.rank)
    for ranks in nodes:
        wrong = [r for r in ranks if seen[r] != set(ranks)]
        if wrong:
            saw = [sorted(seen[r]) for r in wrong]
            raise CheckpointStateError(
                f"directory={directory} is neither shared by every rank nor node-local: ranks "
                f"{list(ranks)} are one node (GPUMEM_NODE, GROUP_RANK, LOCAL_WORLD_SIZE or host "
                f"name), but rank(s) {wrong} see the files of ranks {saw} there. Give every "
                "rank one shared directory, or each node one local directory its ranks share"
            )
    if replicas > len(nodes):
        raise _too_many(replicas, len(nodes), directory)
    return Nodes(True, nodes, g.rank, replicas)


def _too_many(replicas: int, n: int, directory: Path) -> CheckpointStateError:
    return CheckpointStateError(
        f"replicas={replicas} with directory={directory}: the job has {n} node(s), and each "
        f"replica lives on another node; use replicas <= {n}"
    )


def _node_names(g: Group) -> list[str]:
    """Every rank's node name: GPUMEM_NODE, else GROUP_RANK, else rank // LOCAL_WORLD_SIZE, else
    the host name."""
    name = env_str("GPUMEM_NODE") or env_str("GROUP_RANK")
    local = env_int("LOCAL_WORLD_SIZE")
    if name is None and local:  # torchrun without GROUP_RANK: consecutive ranks per node
        name = str(g.rank // local)
    name = name or socket.gethostname()
    data = name.encode()[:255]
    sizes = [row[0] for row in g.all_gather([len(data)])]
    return [b.decode(errors="replace") for b in g.all_gather_bytes(data, sizes)]


def _probe(directory: Path, g: Group) -> list[set[int]]:
    """Per rank, the ranks whose marker it sees in its ``directory``."""
    token = g.broadcast_text(uuid.uuid4().hex if g.rank == 0 else "", 0)
    mine = directory / f"{_PROBE}{token}-{g.rank}"
    wrote = 1
    try:
        directory.mkdir(parents=True, exist_ok=True)
        mine.write_bytes(b"")
    except OSError:
        wrote = 0  # cannot write here: Root says why; taken as shared (today's rule)
    if not all(row[0] for row in g.all_gather([wrote])):
        return [set(range(g.world_size))] * g.world_size
    marks = [int((directory / f"{_PROBE}{token}-{r}").is_file()) for r in range(g.world_size)]
    seen = [{r for r, v in enumerate(row) if v} for row in g.all_gather(marks)]
    with contextlib.suppress(OSError):
        mine.unlink()
    return seen
