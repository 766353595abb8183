"""Restore from node-local directories: the newest step the reachable nodes hold whole, its
missing files fetched from the nodes that hold them.

Each node's directory holds the main manifest and every shard manifest of each step it
committed, its own ranks' data files, and (``replicas=k``) those of the ranks on the k-1 nodes
before it. A node that was replaced has an empty directory; a node that died mid-commit may
lack the newest step. So, collectively:

1. each node's leader lists its steps: main-manifest CRC32C, saved world size, and the saved
   ranks whose shard manifest checks against the main manifest and whose data files are all
   there at their recorded sizes (nothing is read beyond the manifests); the lists are
   all-gathered;
2. every rank computes the same plan from them: the newest step whose holders (the nodes with
   the same main manifest) together hold every saved rank's files. Newer steps held in part
   only (the nodes holding some rank's files were lost, and no replica survived) are skipped
   with a CheckpointFallbackWarning naming the missing ranks; none held whole is a
   CheckpointCorruptError (a step no reachable node holds whole is not restorable);
3. each node's leader receives what its ranks need and its directory lacks, over
   torch.distributed (``storage.peer_files``, CRC-checked): the manifests where the step is
   missing (renamed into place as a committed step once complete), the data files of its own
   ranks at the same world size, of every saved rank otherwise (resharding, replicated state);
4. every rank restores that one step from its own directory (``candidates.restore`` with the
   step's path, so all ranks load the same step), verifying every byte as usual;
5. a step that fails verification there is repaired before anything falls back (``_repair``):
   each leader verifies every chunk of the ranks' files its node holds of that step, drops the
   ranks whose files fail from its inventory, and the inventories are exchanged again; when the
   copies that verified still make the step whole (``replicas=k``), the damaged files are fetched
   from the nodes holding good ones (step 3: CRC-checked on the way, renamed over the damaged
   file) and the step is restored again, with a RuntimeWarning naming what was replaced. Only a
   step that the good copies do not make whole falls back to the next one held whole (steps 3-5
   again), with a CheckpointFallbackWarning.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..capture.training_state import TrainingState
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointFallbackWarning
from ..group import Group
from ..storage import directory as dirs
from ..storage.format import MAIN_MANIFEST, shard_manifest_name, step_dir_name
from ..storage.nodes import peer_files
from ..storage.nodes.topology import Nodes
from ..storage.root import Root
from ..storage.safe_fs import Dir
from .candidates import StagedRestore, restore
from .files import load_shard

# step -> (main manifest CRC, saved world size, replicated, saved ranks held whole)
Held = dict[int, tuple[int, int, bool, set[int]]]


def inventory(root: Dir | None) -> Held:
    """What this node's directory holds whole, per committed step (step 1)."""
    held: Held = {}
    if root is None:
        return held
    for step, name in dirs.step_dirs(root):
        try:
            with dirs.open_step(root, name) as d:
                info = dirs.load_info(d)
                ranks = {r for r in range(info.world_size) if _whole(d, info, r)}
        except CheckpointError:
            continue
        held[step] = (info.manifest_crc32c, info.world_size, info.replicated, ranks)
    return held


def _whole(d: Dir, info: Any, rank: int) -> bool:
    try:
        shard = dirs.load_shard_manifest(d, info, rank)
        for name, size in shard.files.items():
            st = d.lstat(name)
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size < size:
                return False
    except (CheckpointError, OSError):
        return False
    return True


def verified(root: Dir | None, step: int, held: Held) -> Held:
    """This node's inventory of ``step`` (from ``held``) keeping only the saved ranks whose files
    verify completely, every chunk's CRC32C (step 5); empty where the step itself is unreadable."""
    if root is None or step not in held:
        return {}
    crc, world, replicated, ranks = held[step]
    good = set()
    try:
        with dirs.open_step(root, step_dir_name(step)) as d:
            info = dirs.load_info(d)
            for r in sorted(ranks):
                try:
                    load_shard(d, info, r, keep=False)
                    good.add(r)
                except CheckpointCorruptError:
                    continue
    except (CheckpointError, OSError):
        return {}
    return {step: (crc, world, replicated, good)}


def gather(group: Group, nodes: Nodes, held: Held) -> list[Held]:
    """Every node's inventory, by node index (only leaders' count)."""
    mine = b""
    if group.rank == nodes.leader():
        rows = [[s, c, w, int(rep), sorted(r)] for s, (c, w, rep, r) in held.items()]
        mine = json.dumps(rows).encode()
    sizes = [row[0] for row in group.all_gather([len(mine)])]
    blobs = group.all_gather_bytes(mine, sizes)
    out = []
    for n in range(len(nodes.nodes)):
        rows = json.loads(blobs[nodes.leader(n)] or b"[]")
        out.append({int(s): (int(c), int(w), bool(rep), set(r)) for s, c, w, rep, r in rows})
    return out


def complete_steps(
    per_node: list[Held],
) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]]:
    """(the steps held whole, newest first, with the nodes holding them), and the steps held in
    part with the saved ranks whose files no node holds (step 2)."""
    steps = sorted({s for held in per_node for s in held}, reverse=True)
    whole, partial = [], []
    for step in steps:
        crcs = [held[step][0] for held in per_node if step in held]
        crc = max(set(crcs), key=lambda c: (crcs.count(c), -crcs.index(c)))
        holders = [n for n, held in enumerate(per_node) if step in held and held[step][0] == crc]
        world = per_node[holders[0]][step][1]
        have = set().union(*(per_node[n][step][3] for n in holders))
        missing = sorted(set(range(world)) - have)
        if missing:
            partial.append((step, missing))
        else:
            whole.append((step, holders))
    return whole, partial


def plan(
    nodes: Nodes, per_node: list[Held], step: int, holders: list[int], world_size: int
) -> list[peer_files.Transfer]:
    """The transfers that give every node what its ranks need of ``step`` (step 3)."""
    _, saved, replicated, _ = per_node[holders[0]][step]
    everything = saved != world_size or replicated
    out = []
    for n, ranks in enumerate(nodes.nodes):
        have = per_node[n][step][3] if n in holders else set()
        need = set(range(saved)) if everything else {r for r in ranks if r < saved}
        if n not in holders:
            src = nodes.leader(holders[n % len(holders)])
            metas = [MAIN_MANIFEST, *(shard_manifest_name(r) for r in range(saved))]
            out.append(peer_files.Transfer(src, nodes.leader(n), metas))
        for r in sorted(need - have):
            sources = [h for h in holders if r in per_node[h][step][3]]
            src = nodes.leader(sources[n % len(sources)])
            out.append(peer_files.Transfer(src, nodes.leader(n), [f"rank:{r}"]))
    return out


def _whole_steps(per_node: list[Held], directory: Path) -> list[tuple[int, list[int]]]:
    """Step 2: the steps held whole, newest first, with their holders; the newer steps held in
    part are warned about, and none held whole while some are held in part is an error."""
    whole, partial = complete_steps(per_node)
    newest_whole = whole[0][0] if whole else -1
    skipped = [
        f"step {s}: the files of saved rank(s) {missing} are on no node"
        for s, missing in partial
        if s > newest_whole
    ]
    if not whole and skipped:
        raise CheckpointCorruptError(
            f"{directory}: no step is held whole by the nodes this job reaches ("
            + "; ".join(skipped)
            + "): they were on lost nodes, with no replica elsewhere (replicas=k keeps each "
            "rank's files on k nodes). Bring those nodes' directories back, or start afresh",
            path=str(directory),
        )
    for line in skipped:
        warnings.warn(
            f"skipping {line} (lost nodes, no replica left)",
            CheckpointFallbackWarning,
            stacklevel=4,
        )
    return whole


class Restore:
    """A ``candidates.Restorer`` for node-local directories (the module docstring): ``root``
    is this node's, ``directory`` its path; a given ``path`` is restored as ``restore`` does."""

    def __init__(self, nodes: Nodes, root: Root, directory: Path):
        self.nodes, self.root, self.directory = nodes, root, directory

    def __call__(
        self,
        state: TrainingState,
        group: Group,
        stage: Callable[[int], torch.Tensor],
        *,
        path: str | os.PathLike | None = None,
        verify_loaded: bool = False,
    ) -> tuple[int | None, StagedRestore | None]:
        directory = self.directory
        if path is not None:
            return restore(
                state,
                group,
                stage,
                root=None,
                directory=directory,
                path=path,
                verify_loaded=verify_loaded,
            )
        root = self.root.maybe()
        per_node = gather(group, self.nodes, inventory(root) if self._leads(group) else {})
        whole = _whole_steps(per_node, directory)
        failures: list[CheckpointError] = []
        for step, holders in whole:
            self._fetch(group, per_node, step, holders, root)
            label = directory / step_dir_name(step)
            again = functools.partial(
                restore, state, group, stage, root=None, directory=directory, path=label
            )
            try:
                return again(verify_loaded=verify_loaded)
            except CheckpointCorruptError as exc:
                failure = exc
            try:
                if self._repair(group, per_node, step, root):
                    return again(verify_loaded=verify_loaded)
            except CheckpointCorruptError as exc:
                failure = exc
            failures.append(failure)
            warnings.warn(
                f"skipping damaged checkpoint {label.name}: {failure}",
                CheckpointFallbackWarning,
                stacklevel=3,
            )
        if failures:
            raise (
                failures[0]
                if len(failures) == 1
                else CheckpointCorruptError(
                    f"all {len(failures)} checkpoints the nodes hold whole are damaged; newest: "
                    f"{failures[0]}",
                    path=str(directory),
                )
            )
        return None, None

    def _repair(self, group: Group, per_node: list[Held], step: int, root: Dir | None) -> bool:
        """Step 5: the files of ``step`` that fail verification on a node fetched from the nodes
        whose copies verify; True when some were (restore it again), False when no node found
        a damaged file or the good copies do not make the step whole (fall back)."""
        mine = verified(root, step, per_node[self.nodes.node]) if self._leads(group) else {}
        now = gather(group, self.nodes, mine)
        if all(n.get(step) == held.get(step) for n, held in zip(now, per_node, strict=True)):
            return False
        mended = [
            {**{s: v for s, v in held.items() if s != step}, **n}
            for n, held in zip(now, per_node, strict=True)
        ]
        holders = dict(complete_steps(mended)[0]).get(step)
        if holders is None:
            return False
        if group.rank == 0:
            bad = {
                node: sorted(per_node[node][step][3] - n.get(step, (0, 0, False, set()))[3])
                for node, n in enumerate(now)
                if step in per_node[node]
            }
            warnings.warn(
                f"{step_dir_name(step)}: the files of saved rank(s) "
                + "; ".join(f"{r} on node {node}" for node, r in bad.items() if r)
                + " fail their CRC32C; replaced by the copies on the nodes whose files verify "
                "(replicas), and the step restored again",
                RuntimeWarning,
                stacklevel=4,
            )
        self._fetch(group, mended, step, holders, root)
        return True

    def _leads(self, group: Group) -> bool:
        return group.rank == self.nodes.leader()

    def _fetch(
        self, group: Group, per_node: list[Held], step: int, holders: list[int], root: Dir | None
    ) -> None:
        """Step 3 on this rank; raises on every rank when any transfer failed."""
        transfers = plan(self.nodes, per_node, step, holders, group.world_size)
        if not transfers:
            return
        name, tmp_name = step_dir_name(step), dirs.tmp_name(step)
        here = self.nodes.node in holders
        mine = [t for t in transfers if t.dst == group.rank]
        target: Dir | None = None
        failure: BaseException | None = None
        try:
            if mine:
                assert root is not None  # the leader opened (created) it
                target = dirs.open_step(root, name) if here else dirs.prepare_tmp(root, step)
        except (CheckpointError, OSError) as exc:
            failure = exc
        opened: dict[str, Dir] = {}

        def source(t: peer_files.Transfer) -> Dir:
            if name not in opened:
                assert root is not None
                opened[name] = dirs.open_step(root, name)
            d = opened[name]
            if t.names and t.names[0].startswith("rank:"):
                t.names = _files_of(d, int(t.names[0][5:]))
            return d

        def allowed(t: peer_files.Transfer, file: str) -> bool:
            if t.names and t.names[0].startswith("rank:"):
                r = int(t.names[0][5:])
                return file == shard_manifest_name(r) or file.startswith(f"data-r{r:05d}-")
            return file in t.names

        err = peer_files.run(
            group,
            transfers,
            source=source,
            target=lambda t: target,
            allowed=allowed,
        )
        failure = failure or err
        if failure is None and mine and not here:
            assert root is not None and target is not None
            try:  # a failure here still reaches the all-gather below, as every rank must
                info = dirs.load_info(target)
                dirs.commit(root, target, step, info.manifest_crc32c)
            except (CheckpointError, OSError) as exc:
                failure = exc
        for d in opened.values():
            d.close()
        if target is not None:
            target.close()
        bad = [r for r, (ok,) in enumerate(group.all_gather([int(failure is None)])) if not ok]
        if bad:
            raise CheckpointCorruptError(
                f"fetching step {step}'s files from the nodes that hold them failed on rank(s) "
                f"{bad}" + (f": {failure}" if failure is not None else ""),
                path=tmp_name,
            )


def _files_of(d: Dir, rank: int) -> list[str]:
    """Saved rank ``rank``'s shard manifest and data files in the step directory ``d``."""
    info = dirs.load_info(d)
    shard = dirs.load_shard_manifest(d, info, rank)
    return [shard_manifest_name(rank), *sorted(shard.files)]
