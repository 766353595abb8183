"""SaveStats: what one save cost, filled in by each stage as it goes (the copy's figures by the
snapshot, the commit's by the writes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SaveStats:
    """What one save cost. ``stall_s`` is what training lost: save() time plus optimizer-hook waits.

    Attributes:
        step: the step saved.
        nbytes: tensor bytes this rank staged (with replicated=True, its share).
        mode: "overlap", "blocking" or "streaming".
        save_s: time save() blocked the caller (including back-pressure from the previous save).
        hook_wait_s: time optimizer.step() waited for the background copy (overlap mode), on the
            host: with CUDA state only until the copy was enqueued (the fence then makes the
            optimizer's stream wait instead).
        fence_s: how long the optimizer's CUDA stream stood still at that fence (CUDA events;
            0 without a fence, or when the copy had completed before the stream got there).
        spill_bytes: bytes the fence copied into the device spill buffer (``device_spill_bytes``;
            0: none).
        cold_bytes: of ``nbytes``, the bytes that waited for staging memory: copied into arena
            pages not yet faulted in (a save right after ``prepare()``, or the first save
            without it, while the arena's pages are still being faulted in and locked in the
            background), so the copy faulted them itself. 0 once the arena is ready.
        staged_s: from save() entry until every tensor was in host memory.
        d2h_s: of that, the time from enqueuing the first device-to-host copy until the copies
            and the device CRCs completed (0 without CUDA tensors); ``nbytes / d2h_s`` is the
            snapshot's D2H throughput.
        copy_device_s, crc_device_s: on the device (CUDA events), from the point the snapshot's
            streams started until the copies, and the CRCs, completed (they run side by side).
        durable_s: from save() entry until the checkpoint was committed: its directory renamed
            into place and the rename fsync'ed (``latest`` is moved after it).
        set_aside: checkpoints of an abandoned branch this save moved to ``abandoned/`` (it
            saved a step lower than committed ones; see ``storage.directory.set_aside_newer``).
        committed: the step's directory was renamed into place: the checkpoint is durable and
            restore() finds it, whatever happens to ``latest`` afterwards.
        latest_error: why the ``latest`` pointer was not moved to this step although it was
            committed (empty: it was, or the save did not get that far).
        superseded_by: with ``coalesce=True``, the step whose snapshot replaced this one before
            it was written (None: not superseded; such a save is never committed).
        supersedes: with ``coalesce=True``, the step this save replaced (None: none).
        remote: with ``remote=`` (tiers), where its upload stands: "queued", "uploading",
            "uploaded", "not uploaded: superseded by step N while an upload ran", "upload
            failed: ..." ("": no remote tier). See ``tiers``.
        remote_committed: the step is committed in the object store too.
        remote_s: how long its upload took, from start to the remote commit.
    """

    step: int
    nbytes: int
    mode: str
    save_s: float = 0.0
    hook_wait_s: float = 0.0
    staged_s: float = 0.0
    d2h_s: float = 0.0
    fence_s: float = 0.0
    spill_bytes: int = 0
    cold_bytes: int = 0
    copy_device_s: float = 0.0
    crc_device_s: float = 0.0
    durable_s: float = 0.0
    set_aside: tuple[str, ...] = ()
    committed: bool = False
    latest_error: str = ""
    superseded_by: int | None = None
    supersedes: int | None = None
    remote: str = ""
    remote_committed: bool = False
    remote_s: float = 0.0

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers that hold this step committed: ("local",), ("local", "remote"), ()."""
        held = (("local", self.committed), ("remote", self.remote_committed))
        return tuple(name for name, ok in held if ok)

    @property
    def stall_s(self) -> float:
        return self.save_s + self.hook_wait_s

    @property
    def status(self) -> str:
        """ "committed", "committed; latest not updated (why)", or "not committed" (yet, or
        because the save failed: wait() says which)."""
        if self.superseded_by is not None:
            return f"superseded by step {self.superseded_by} (not written)"
        if not self.committed:
            return "not committed"
        if self.latest_error:
            return f"committed; latest not updated ({self.latest_error})"
        return "committed"
