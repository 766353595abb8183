"""Type-checked by mypy (tests/test_house.py), never run: interfaces implemented by shape.

A module that calls back into a higher one types it with a ``Protocol`` instead of importing it
(no import circle, tests/test_import_graph.py); each function here proves that the real class
still has every member the protocol names, with the same types.
"""

from __future__ import annotations

from gpumem.checkpoint.restore.candidates import NewestRestore, Restorer
from gpumem.checkpoint.restore.peers import Restore
from gpumem.checkpoint.storage.backend import Candidates, SaveCommit, StepFiles, StorageRoot
from gpumem.checkpoint.storage.commit import Commit
from gpumem.checkpoint.storage.root import DirCandidates, Root
from gpumem.checkpoint.storage.s3.object_backend import ObjectBackend, ObjectCandidates
from gpumem.checkpoint.storage.s3.object_commit import ObjectCommit
from gpumem.checkpoint.storage.s3.object_files import ObjectFiles
from gpumem.checkpoint.storage.safe_fs import Dir
from gpumem.profiler.communication import CommHost
from gpumem.profiler.hooks import ProfileEvents
from gpumem.profiler.levels import Levels, LevelsHost
from gpumem.profiler.memory_viz import TimelineLike
from gpumem.profiler.modes import ModeHost
from gpumem.profiler.pictures import ReportLike
from gpumem.profiler.report import Report
from gpumem.profiler.session import Profile


def profile_is_what_the_hooks_call(prof: Profile) -> ProfileEvents:
    return prof


def profile_is_what_the_modes_call(prof: Profile) -> ModeHost:
    return prof


def levels_are_what_the_communication_account_calls(levels: Levels) -> CommHost:
    return levels


def profile_is_what_the_levels_call(prof: Profile) -> LevelsHost:
    return prof


def report_is_what_the_pictures_read(rep: Report) -> ReportLike:
    return rep


def report_is_what_the_snapshot_reads(rep: Report) -> TimelineLike:
    return rep


# the storage seam (gpumem/checkpoint/storage/backend.py): each backend, by shape


def a_directory_is_a_root(root: Root) -> StorageRoot:
    return root


def an_object_store_is_a_root(root: ObjectBackend) -> StorageRoot:
    return root


def a_directory_commit_is_a_save_commit(commit: Commit) -> SaveCommit:
    return commit


def an_object_commit_is_a_save_commit(commit: ObjectCommit) -> SaveCommit:
    return commit


def a_directory_lists_candidates(found: DirCandidates) -> Candidates:
    return found


def an_object_store_lists_candidates(found: ObjectCandidates) -> Candidates:
    return found


def a_step_directory_is_read(step: Dir) -> StepFiles:
    return step


def a_step_of_objects_is_read(step: ObjectFiles) -> StepFiles:
    return step


def the_newest_restore_is_a_restorer(run: NewestRestore) -> Restorer:
    return run


def the_peers_restore_is_a_restorer(run: Restore) -> Restorer:
    return run
