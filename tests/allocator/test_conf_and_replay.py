"""PYTORCH_CUDA_ALLOC_CONF parsing and its errors; replay of a hand-written snapshot; traces."""

import pickle

import pytest

from gpumem.allocator import AllocConf, Trace, replay_snapshot, simulate
from gpumem.allocator.alloc_conf import KNOWN_KEYS, resolve

MiB = 1 << 20


# -- the config -----------------------------------------------------------------------------------
def test_parse_every_simulated_option():
    c = AllocConf.parse(
        "max_split_size_mb:256, max_non_split_rounding_mb:64,garbage_collection_threshold:0.8,"
        "expandable_segments:True,roundup_power2_divisions:2,per_process_memory_fraction:0.5"
    )
    assert c.max_split_size == 256 * MiB and c.max_non_split_rounding_size == 64 * MiB
    assert c.garbage_collection_threshold == 0.8 and c.expandable_segments
    assert c.roundup_power2_divisions == (2,) * 16 and c.per_process_memory_fraction == 0.5
    # accepted, no effect on device memory
    assert AllocConf.parse("backend:native,pinned_num_register_threads:8") == AllocConf()
    assert AllocConf.parse("") == AllocConf()


def test_env_is_read_pytorch_alloc_conf_first(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert resolve(None).expandable_segments
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:100")
    c = resolve(None)
    assert c.max_split_size == 100 * MiB and not c.expandable_segments


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("max_split_mb:100", "unknown option 'max_split_mb'; known options: max_split_size_mb"),
        ("max_split_size_mb", "option 'max_split_size_mb' is missing its value"),
        ("max_split_size_mb=100", "unknown option 'max_split_size_mb=100'"),
        ("max_split_size_mb:abc", "needs a non-negative integer, got 'abc'"),
        ("max_split_size_mb:10", "is 10, must be >= 20"),
        ("garbage_collection_threshold:1.5", "must be in (0.0, 1.0)"),
        ("expandable_segments:yes", "needs True or False, got 'yes'"),
        ("roundup_power2_divisions:3", "must be a power of 2"),
        ("roundup_power2_divisions:[100:2]", "intervals must be powers of 2"),
        ("backend:cudaMallocAsync", "not simulated"),
        ("expandable_segments:True,", "ends with ','"),
        ("expandable_segments:True max_split_size_mb:30", "is followed by 'max_split_size_mb'"),
    ],
)
def test_bad_settings_are_one_line_value_errors(text, says):
    with pytest.raises(ValueError) as e:
        AllocConf.parse(text)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and msg.startswith(f"alloc_conf {text!r}")


def test_unknown_option_lists_the_known_ones_and_says_it_came_from_the_env(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segment:True")
    with pytest.raises(ValueError) as e:
        resolve(None)
    msg = str(e.value)
    assert msg.startswith("the environment variable PYTORCH_CUDA_ALLOC_CONF 'expandable_segment:")
    assert all(k in msg for k in KNOWN_KEYS)
    with pytest.raises(TypeError, match="alloc_conf must be"):
        resolve(3)  # type: ignore[arg-type]


# -- replay ---------------------------------------------------------------------------------------
def _entry(action, addr, size=0, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}


HAND = {
    "segments": [],
    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""},
    "device_traces": [
        [
            _entry("segment_alloc", 0x1000000, 20 * MiB),
            _entry("alloc", 0x1000000, 3 * MiB),  # a
            _entry("alloc", 0x1300000, 5 * MiB),  # b, same segment
            _entry("free_requested", 0x1000000, 3 * MiB),  # a: freed at once
            _entry("free_completed", 0x1000000, 3 * MiB),
            _entry("free_requested", 0x1300000, 5 * MiB),  # b: used on another stream
            _entry("segment_alloc", 0x3000000, 16 * MiB),
            _entry("alloc", 0x3000000, 15 * MiB),  # c: b's block is still held
            _entry("free_completed", 0x1300000, 5 * MiB),  # b done
            _entry("free_requested", 0x7000000, 1 * MiB),  # predates the recording
            {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
            _entry("alloc", 0x1000000, 2 * MiB),  # d
        ]
    ],
}


def test_replay_of_a_hand_written_snapshot():
    # simulated: a (3) and b (5) in one 20 MiB segment; a freed; b held (free_completed comes
    # later); c = 15 MiB cannot use the 12 MiB tail nor b's held block: a segment of its own,
    # 16 MiB (>= 10 MiB: rounded up to 2 MiB), handed out whole (1 MiB left: no split): 36 MiB,
    # as the trace's two segment_allocs say; then b completes; d takes 2 MiB of the first
    # segment's merged free 20 MiB
    r = replay_snapshot(HAND)
    assert (r.sim.peak_reserved, r.trace_reserved_peak) == (36 * MiB, 36 * MiB)
    # allocated drops at a free_requested, held or not: the peak is c + d, as asked (15 + 2)
    assert r.trace_allocated_peak == 17 * MiB
    assert r.sim.peak_allocated == 18 * MiB  # with c's unsplit 16 MiB block
    assert r.unmatched_frees == 1 and r.entries == 12
    assert [e[0] for e in r.events] == [
        "alloc",
        "alloc",
        "free",
        "record_stream",
        "free",
        "alloc",
        "free_completed",
        "alloc",
    ]
    assert r.sim.allocated_at_end == 18 * MiB  # c's 16 and d's 2


def test_replay_reads_a_pickle_and_takes_its_settings(tmp_path):
    snap = {**HAND, "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snap))
    r = replay_snapshot(path)
    assert r.sim.conf.expandable_segments
    # one growing mapping: a, b fill 8 MiB of the first 20 MiB page; c = 15 MiB takes the free
    # 12 MiB at its end and maps a second page
    assert r.sim.peak_reserved == 40 * MiB
    assert replay_snapshot(path, "").sim.conf == AllocConf()  # alloc_conf= wins


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("alloc", "device_traces[0][1]: a trace entry is a dict, got str"),
        ({"action": "malloc", "addr": 1}, "device_traces[0][1]: unknown action 'malloc'"),
        (
            {"action": "alloc", "addr": 1},
            "device_traces[0][1]: 'alloc' entry needs an integer 'size'",
        ),
        ({"action": "free_requested"}, "needs an integer 'addr'"),
    ],
)
def test_replay_names_the_bad_entry(entry, says):
    snap = {"device_traces": [[_entry("alloc", 0, 512), entry]]}
    with pytest.raises(ValueError, match=".*".join(map(__import__("re").escape, says.split("'")))):
        replay_snapshot(snap)


def test_replay_bad_files(tmp_path):
    p = tmp_path / "x.pickle"
    p.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not a memory snapshot pickle"):
        replay_snapshot(p)
    p.write_bytes(pickle.dumps({"segments": []}))
    with pytest.raises(ValueError, match="was history recorded"):
        replay_snapshot(p)
    with pytest.raises(ValueError, match="device_traces for 1 device"):
        replay_snapshot(HAND, device=1)


# -- traces ---------------------------------------------------------------------------------------
def test_trace_extend_renumbers_a_layer():
    layer = Trace()
    a = layer.alloc(3 * MiB)
    layer.free(a)
    layer.alloc(1 * MiB)  # kept: one per layer
    t = Trace()
    t.alloc(512)
    assert t.extend(layer, times=3) == [1, 3, 5]
    assert t.events[1:4] == [("alloc", 1, 3 * MiB, 0), ("free", 1), ("alloc", 2, MiB, 0)]
    r = t.simulate("")
    # 3 MiB: a 20 MiB large segment, reused by each layer; 1 MiB is small (<= kSmallSize):
    # 512 B + 1 MiB share one 2 MiB segment, the next two 1 MiB fill a second: 24 MiB
    assert (r.peak_reserved, r.allocated_at_end) == (24 * MiB, 512 + 3 * MiB)
    assert r.peak_reserved == simulate(t.events, "").peak_reserved


def test_trace_file_round_trip_and_errors(tmp_path):
    t = Trace()
    h = t.alloc(3 * MiB, stream=2)
    t.free(h)
    t.empty_cache()
    p = tmp_path / "t.jsonl"
    t.dump(p)
    back = Trace.load(p)
    assert back.events == t.events and back.alloc(1) == 1
    p.write_text('["alloc", 1, 512]\n\n["free" 1]\n')
    with pytest.raises(ValueError, match=r"t.jsonl, line 3: not JSON"):
        Trace.load(p)
    p.write_text('["alloc", 1, -5]\n')
    with pytest.raises(ValueError, match=r"line 1: an alloc's size must be a non-negative"):
        Trace.load(p)
    p.write_text('["resize", 1]\n')
    with pytest.raises(ValueError, match=r"line 1: \['resize', 1\] is not an allocator event"):
        Trace.load(p)


def test_replay_counts_expandable_maps_and_skips_ooms():
    e = _entry
    snap = {
        "device_traces": [
            [
                e("segment_map", 0x10000000, 20 * MiB),
                e("alloc", 0x10000000, 3 * MiB),
                e("segment_map", 0x11400000, 20 * MiB),
                e("alloc", 0x10300000, 30 * MiB),
                e("free_requested", 0x10300000, 30 * MiB),
                e("free_completed", 0x10300000, 30 * MiB),
                e("segment_unmap", 0x11400000, 20 * MiB),
                {"action": "oom", "size": 1 << 40, "device_free": 0, "stream": 0},
            ]
        ]
    }
    r = replay_snapshot(snap, "expandable_segments:True")
    # the trace: 20 + 20 mapped, then 20 unmapped: its peak is 40 MiB, as simulated
    assert (r.trace_reserved_peak, r.sim.peak_reserved) == (40 * MiB, 40 * MiB)
    # the unmap empties the simulated cache too: the free second page goes, a's first stays
    assert r.sim.reserved_at_end == 20 * MiB
    assert [ev[0] for ev in r.events] == ["alloc", "alloc", "free", "empty_cache"]


class _Hostile:
    """Unpickles by calling a function: what a hostile snapshot file does."""

    def __reduce__(self):
        return (_ran.append, ("code ran",))


_ran: list[str] = []


def test_replay_never_runs_what_a_pickle_names(tmp_path):
    p = tmp_path / "hostile.pickle"
    p.write_bytes(pickle.dumps({"device_traces": [[]], "x": _Hostile()}))
    with pytest.raises(ValueError, match=r"not a memory snapshot pickle \(it names builtins\."):
        replay_snapshot(p)
    assert _ran == []
    # the same snapshot as plain data loads (the check refuses classes, not snapshots)
    p.write_bytes(pickle.dumps({"device_traces": [[]]}))
    assert replay_snapshot(p).unmatched_frees == 0
