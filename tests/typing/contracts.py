"""Type-checked by mypy (tests/test_house.py), never run: interfaces implemented by shape.

A module that calls back into a higher one types it with a ``Protocol`` instead of importing it
(no import circle, tests/test_import_graph.py); each function here proves that the real class
still has every member the protocol names, with the same types.
"""

from __future__ import annotations

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
