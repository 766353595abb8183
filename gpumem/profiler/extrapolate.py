"""The profile of a model with N identical blocks, from profiles of the same model with 1, 2 and 3.

A fake profile's cost is one Python dispatch per op, so it grows with the block count: 80
Llama-2-70B blocks take seconds where 3 take a fraction. When the blocks are provably twins
(:func:`twin_problem`) the step is periodic in the block count, and the report follows from
three short profiles (docs/profiler.md, "Identical blocks"):

- the timeline: each (step, phase) stretch of samples, each sample with its bytes per category
  and whether the root module's forward or backward is running (``samples.SampleRecorder``), is for
  k + 1 blocks the stretch for k blocks with runs of per-op changes inserted (repeated once per
  extra block) and runs replaced by changes affine in k. The rule fitted on k = 1 and 2 must
  give the 3-block stretch exactly; it then gives the N-block one. Every peak (run, step,
  phase: bytes, where, the categories there) and the root module's temporaries are read off
  those N-block samples, not fitted, so a peak that moves as N grows moves as in the full run.
  Only the samples a maximum can be at take part (:func:`_records`);
- the rows of the blocks (and their submodules) are copies: equal in every profile and step;
- every other figure (the other rows, counts) must be affine in k, checked on the three
  profiles, and is extrapolated.

Reading the derived figures off each k-block profile's own samples must reproduce that
profile's report; any check that fails leaves the caller to run the full profile
(:class:`NotExtrapolated` says why). The result has no timeline or spans and no simulated
caching allocator (which cached block a request reuses depends on the whole history: its
figures are not periodic in the blocks), and says where it came from (``Report.extrapolated``).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from typing import Any

import torch

from gpumem.profiler.categories import CATEGORIES, PHASES
from gpumem.profiler.records import PHASE_CODE
from gpumem.profiler.report import Report

PROFILED = (1, 2, 3)
"""The block counts profiled: the rule is fitted on the first two and checked on the third."""
_LEVEL, _COMM, _PHASE, _STEP, _ROOT_FWD, _ROOT_BWD, _CAT0 = range(7)
_PHASE_NAME = {v: k for k, v in PHASE_CODE.items()}
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)
_ROOT_DERIVED = ("temporary", "forward_temporary", "backward_temporary")
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


class NotExtrapolated(Exception):
    """Why a model's profile cannot be had from k-block profiles (the message says)."""


def twin_problem(model: torch.nn.Module, blocks_fqn: str) -> str | None:
    """Why the children of ``blocks_fqn`` (a ``ModuleList``) are not identical twins, or
    ``None`` when they are: same classes, no instance-level ``forward``, no hooks, the same
    parameter and buffer metadata and the same plain attributes in every submodule (a
    ``layer_idx`` differs), nothing shared with the rest of the model, and the list a child of
    the root (the model's forward is the one call around the blocks)."""
    if "." in blocks_fqn or not blocks_fqn:
        return f"the blocks ({blocks_fqn or 'the root'}) are not a child list of the model"
    blocks = list(model.get_submodule(blocks_fqn))
    if len(blocks) < 2:
        return "fewer than two blocks"
    sig = _signature(blocks[0])
    for i, b in enumerate(blocks[1:], 1):
        other = _signature(b)
        if other != sig:
            diff = next(
                (f"{x[0] or '(block)'}" for x, y in zip(sig, other, strict=False) if x != y), "?"
            )
            return f"{blocks_fqn}.{i} differs from {blocks_fqn}.0 (in {diff})"
    inside = {id(t) for b in blocks for t in [*b.parameters(), *b.buffers()]}
    outside = [
        t
        for name, m in model.named_modules()
        if name != blocks_fqn and not name.startswith(blocks_fqn + ".")
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
    ]
    if any(id(t) in inside for t in outside):
        return f"{blocks_fqn} shares a parameter or buffer with the rest of the model"
    if len(inside) != sum(len([*b.parameters(), *b.buffers()]) for b in blocks):
        return "blocks share parameters or buffers with each other"
    return None


def _signature(block: torch.nn.Module) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for name, m in block.named_modules(remove_duplicate=False):
        attrs = vars(m)
        if "forward" in attrs or any(attrs.get(h) for h in _HOOK_DICTS):
            out.append((name, "hooks or its own forward", id(m)))
            continue
        plain = []
        for k, v in sorted(attrs.items()):
            if k in ("_parameters", "_buffers", "_modules") or k in _HOOK_DICTS:
                continue
            if isinstance(v, (set, frozenset)) and all(isinstance(x, str) for x in v):
                v = tuple(sorted(v))  # e.g. _non_persistent_buffers_set
            elif isinstance(v, dict) and not v:
                v = ()
            elif isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
                v = (type(v), tuple(v))
            elif not isinstance(v, _PLAIN):
                v = ("object", id(v))  # anything else is the same only if it is the same object
            plain.append((k, v))
        tensors = [
            (k, type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
            for d in (m._parameters, m._buffers)
            for k, t in d.items()
            if t is not None
        ]
        out.append((name, type(m), tuple(plain), tuple(tensors)))
    return out


# -- the sample sequences --------------------------------------------------------------------


def _table(samples: list[list[int]]) -> torch.Tensor:
    """Samples as one int64 tensor, a row each (vector arithmetic on tens of thousands)."""
    return torch.tensor(samples, dtype=torch.int64).reshape(len(samples), -1)


def _records(t: torch.Tensor) -> torch.Tensor:
    """The samples every figure read here depends on: in each run of one step, phase and root
    state, its first sample and each one above all before it in the run (every maximum is the
    first of the highest). Others may differ between equal runs: where a free lands between two
    ops depends on whether FakeTensorMode's cache answered an op (a cold miss can add a sample
    at a dip), which never moves a maximum."""
    if not len(t):
        return t
    key = ((t[:, _STEP] * len(PHASES) + t[:, _PHASE]) * 2 + t[:, _ROOT_FWD]) * 2 + t[:, _ROOT_BWD]
    cuts = [0, *((key[1:] != key[:-1]).nonzero().flatten() + 1).tolist(), len(t)]
    keep = torch.zeros(len(t), dtype=torch.bool)
    for i, j in itertools.pairwise(cuts):
        level = t[i:j, _LEVEL]
        before = level.cummax(0).values[:-1]
        keep[i] = True
        keep[i + 1 : j] = level[1:] > before
    return t[keep]


def _stretches(t: torch.Tensor) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """The samples cut into runs of one (step, phase)."""
    if not len(t):
        return []
    key = t[:, _STEP] * len(PHASES) + t[:, _PHASE]
    cuts = [0, *((key[1:] != key[:-1]).nonzero().flatten() + 1).tolist(), len(t)]
    return [((int(t[i, _STEP]), int(t[i, _PHASE])), t[i:j]) for i, j in itertools.pairwise(cuts)]


def _rule(a: torch.Tensor, b: torch.Tensor, ka: int) -> Any:
    """The rule taking the stretch of ``ka`` blocks (``a``) to that of ``ka + 1`` (``b``) and on,
    as ``predict(k)``, or ``None``. The per-sample changes of ``b`` are those of ``a`` aligned
    (``difflib``) with runs inserted, each repeated once per extra block, and runs of as many
    changes replaced, each change affine in k; the first sample is affine in k."""
    if not len(a) or not len(b):
        return None
    da, db = a[1:] - a[:-1], b[1:] - b[:-1]
    ops = difflib.SequenceMatcher(
        None, list(map(tuple, da.tolist())), list(map(tuple, db.tolist())), autojunk=False
    ).get_opcodes()
    if any(
        op == "delete" or (op == "replace" and i1 - i0 != j1 - j0) for op, i0, i1, j0, j1 in ops
    ):
        return None
    start = b[0] - a[0]

    def predict(k: int) -> torch.Tensor:
        m = k - ka
        changes = [a[:1] + m * start]
        for op, i0, i1, j0, j1 in ops:
            if op == "equal":
                changes.append(da[i0:i1])
            elif op == "insert":
                changes.append(db[j0:j1].repeat(m, 1))
            else:  # replace: affine in k
                changes.append(da[i0:i1] + m * (db[j0:j1] - da[i0:i1]))
        return torch.cat(changes).cumsum(0)

    return predict


def extrapolated_samples(runs: dict[int, torch.Tensor], n: int) -> torch.Tensor:
    """The N-block samples from the 1-, 2- and 3-block ones (see the module docstring).

    Raises:
        NotExtrapolated: the stretches differ in kind, or the rule from 1 and 2 blocks does not
            give the 3-block samples exactly."""
    k1, _, k3 = PROFILED
    parts = {k: _stretches(runs[k]) for k in PROFILED}
    keys = [key for key, _ in parts[k1]]
    if any([key for key, _ in parts[k]] != keys for k in PROFILED):
        _fail("the profiles' steps and phases differ")
    out = []
    for i, key in enumerate(keys):
        a, b, c = (parts[k][i][1] for k in PROFILED)
        rule = _rule(a, b, k1)
        if rule is None or not torch.equal(rule(k3), c):
            step, phase = key
            _fail(f"step {step} {_PHASE_NAME[phase]}'s timeline is not periodic in the blocks")
        out.append(rule(n))
    return torch.cat(out)


def _fail(why: str) -> Any:
    raise NotExtrapolated(why)


# -- figures read off a sample sequence --------------------------------------------------------


def peaks_of(t: torch.Tensor) -> dict[str, Any]:
    """The peaks a profile with these samples reports: the run's and each step's (first
    moment of the highest level: bytes, step, phase, categories) and each step's phase peaks."""
    steps: dict[int, dict[str, Any]] = {}
    for (step, phase), part in _stretches(t):
        s = steps.setdefault(step, {"row": None, "phases": dict.fromkeys(PHASES)})
        i = int(part[:, _LEVEL].argmax())  # the first of the highest
        level = int(part[i, _LEVEL])
        name = _PHASE_NAME[phase]
        pp = s["phases"][name]
        s["phases"][name] = level if pp is None else max(pp, level)
        if s["row"] is None or level > s["row"][_LEVEL]:
            s["row"] = part[i].tolist()
    best = None
    for s in steps.values():
        if best is None or s["row"][_LEVEL] > best[_LEVEL]:
            best = s["row"]
    return {"run": best, "steps": steps}


def _at(row: list[int]) -> dict[str, int | None]:
    return dict(zip(CATEGORIES, row[_CAT0:], strict=True))


def root_temporaries(t: torch.Tensor, calls: list[Any]) -> dict[int, tuple[int, int]]:
    """Per step, the root module's forward and backward temporary: each call's high-water mark
    (the most bytes, communication left out, while it ran) above its entry level, less what it
    kept. ``calls`` are (step, backward, entry level, kept[, recorded high-water mark]); the
    mark is recomputed from the samples, and must equal the recorded one where there is one."""
    work = t[:, _LEVEL] - t[:, _COMM]
    windows: dict[bool, list[int]] = {}
    for flag, bwd in ((_ROOT_FWD, False), (_ROOT_BWD, True)):
        zero = torch.zeros(1, dtype=torch.int64)
        on = torch.cat([zero, t[:, flag], zero])
        edges = (on[1:] - on[:-1]).nonzero().flatten().tolist()  # starts and ends, in turn
        windows[bwd] = [int(work[i:j].max()) for i, j in zip(edges[::2], edges[1::2], strict=True)]
    seen = {False: 0, True: 0}
    out: dict[int, tuple[int, int]] = {}
    for step, bwd, level, kept, *recorded in calls:
        marks = windows[bwd]
        if seen[bwd] >= len(marks):
            _fail("the root module's calls do not match the samples")
        hwm = max(level, marks[seen[bwd]])
        if recorded and recorded[0] != hwm:
            _fail("the root module's high-water mark does not follow from the samples")
        seen[bwd] += 1
        f, b = out.get(step, (0, 0))
        temp = max(0, hwm - level - kept)
        out[step] = (f, max(b, temp)) if bwd else (max(f, temp), b)
    if seen[False] != len(windows[False]) or seen[True] != len(windows[True]):
        _fail("the root module's calls do not match the samples")
    return out


# -- the report --------------------------------------------------------------------------------


def _affine(xs: tuple[Any, Any, Any], n: int, where: str) -> Any:
    """``xs`` at k = 1, 2, 3 taken to k = n: numbers affine in k (checked), the rest equal."""
    a, b, c = xs
    if type(a) is int and type(b) is int and type(c) is int:
        if c - b != b - a:
            _fail(f"{where} is not affine in the block count ({a}, {b}, {c})")
        return c + (n - PROFILED[2]) * (c - b)
    if isinstance(a, dict):
        if not (isinstance(b, dict) and isinstance(c, dict) and a.keys() == b.keys() == c.keys()):
            _fail(f"{where} has different keys")
        return {k: _affine((a[k], b[k], c[k]), n, f"{where}.{k}") for k in a}
    if isinstance(a, list):
        if not (isinstance(b, list) and isinstance(c, list) and len(a) == len(b) == len(c)):
            _fail(f"{where} has different lengths")
        return [
            _affine((x, y, z), n, f"{where}[{i}]")
            for i, (x, y, z) in enumerate(zip(a, b, c, strict=True))
        ]
    if not (a == b == c and type(a) is type(b) is type(c)):
        _fail(f"{where} differs between the profiles ({a!r}, {b!r}, {c!r})")
    return c


def _layers(
    rows: tuple[dict[str, Any], dict[str, Any], dict[str, Any]], prefix: str, n: int, where: str
) -> dict[str, Any]:
    """Layer rows at N blocks: the blocks' rows copied (equal in every profile), the others
    affine in k."""
    template: dict[str, Any] | None = None
    others: list[dict[str, Any]] = []
    order: list[str | None] = []
    for k, layer_rows in zip(PROFILED, rows, strict=True):
        blocks: dict[int, dict[str, Any]] = {}
        rest: dict[str, Any] = {}
        names: list[str | None] = []
        for name, row in layer_rows.items():
            if name.startswith(prefix + "."):
                number, _, sub = name[len(prefix) + 1 :].partition(".")
                if not blocks:
                    names.append(None)  # where the blocks go
                blocks.setdefault(int(number), {})[sub] = row
            else:
                if name == "":  # its temporaries are read off the samples (_derived)
                    row = {f: v for f, v in row.items() if f not in _ROOT_DERIVED}
                rest[name] = row
                names.append(name)
        if sorted(blocks) != list(range(k)):
            _fail(f"{where}: the profile of {k} blocks has rows for blocks {sorted(blocks)}")
        for j, block in blocks.items():
            if template is None:
                template = block
            elif block != template:
                _fail(f"{where}: {prefix}.{j}'s rows differ from {prefix}.0's (k={k})")
        others.append(rest)
        order = names
    assert template is not None
    rest_n = _affine((others[0], others[1], others[2]), n, where)
    out: dict[str, Any] = {}
    for entry in order:
        if entry is not None:
            out[entry] = rest_n[entry]
            continue
        for index in range(n):
            for sub, row in template.items():
                out[f"{prefix}.{index}" + (f".{sub}" if sub else "")] = dict(row)
    return out


def _derived(rep: dict[str, Any], peaks: dict[str, Any], roots: dict[int, tuple[int, int]]) -> None:
    """Write the figures read off the samples into a report dict."""
    run = peaks["run"]
    rep["peak_bytes"], rep["at_peak"] = run[_LEVEL], _at(run)
    rep["peak_step"], rep["peak_phase"] = run[_STEP], _PHASE_NAME[run[_PHASE]]
    for s in rep["steps"]:
        got = peaks["steps"][s["index"]]
        row = got["row"]
        s["peak"], s["at_peak"], s["peak_phase"] = row[_LEVEL], _at(row), _PHASE_NAME[row[_PHASE]]
        for phase in PHASES:
            s[f"{phase}_peak"] = got["phases"][phase]
        f, b = roots.get(s["index"], (0, 0))
        s["layers"][""].update(forward_temporary=f, backward_temporary=b, temporary=max(f, b))
    root = rep["layers"][""]
    f = max(s["layers"][""]["forward_temporary"] for s in rep["steps"])
    b = max(s["layers"][""]["backward_temporary"] for s in rep["steps"])
    root.update(forward_temporary=f, backward_temporary=b, temporary=max(f, b))


def extrapolate(
    runs: dict[int, tuple[Report, list[list[int]], list[tuple[int, bool, int, int, int]]]],
    prefix: str,
    n: int,
) -> Report:
    """The report of ``n`` blocks from ``runs[k] = (report, samples, root calls)`` for k = 1,
    2, 3 (exact mode, timeline recorded).

    Raises:
        NotExtrapolated: a check failed (the message names it)."""
    dicts, tables = {}, {}
    for k in PROFILED:
        rep, samples, calls = runs[k]
        d = dataclasses.replace(rep, timeline={}, spans=[]).to_dict()
        tables[k] = samples = _records(_table(samples))
        if len(samples) and samples[:, _COMM].any():
            _fail("communication bytes (sharded models) are not extrapolated")
        mine = {**d, "steps": [dict(s, layers=dict(s["layers"])) for s in d["steps"]]}
        mine["layers"] = {**d["layers"], "": dict(d["layers"][""])}
        for s in mine["steps"]:
            s["layers"][""] = dict(s["layers"][""])
        _derived(mine, peaks_of(samples), root_temporaries(samples, calls))
        if mine != d:
            bad = next(key for key in d if mine[key] != d[key])
            _fail(f"the {k}-block profile's {bad} does not follow from its samples")
        if rep.mode != "exact" or rep.error or rep.allocator:
            _fail("only a complete exact-mode profile without a CUDA allocator extrapolates")
        dicts[k] = d
    a, b, c = (dicts[k] for k in PROFILED)
    out: dict[str, Any] = {}
    derived = ("peak_bytes", "at_peak", "peak_step", "peak_phase", "layers", "steps")
    for key in a:
        if key not in derived and key != "extrapolated":
            out[key] = _affine((a[key], b[key], c[key]), n, key)
    out["layers"] = _layers((a["layers"], b["layers"], c["layers"]), prefix, n, "layers")
    steps = []
    if not len(a["steps"]) == len(b["steps"]) == len(c["steps"]):
        _fail("the profiles have different numbers of steps")
    for i, trio in enumerate(zip(a["steps"], b["steps"], c["steps"], strict=True)):
        s = {
            key: _affine((trio[0][key], trio[1][key], trio[2][key]), n, f"steps[{i}].{key}")
            for key in trio[0]
            if key not in ("layers", "peak", "at_peak", "peak_phase") and not key.endswith("_peak")
        }
        rows = (trio[0]["layers"], trio[1]["layers"], trio[2]["layers"])
        s["layers"] = _layers(rows, prefix, n, f"steps[{i}].layers")
        steps.append(s)
    out["steps"] = steps
    samples = extrapolated_samples(tables, n)
    calls = _root_calls({k: runs[k][2] for k in PROFILED}, n)
    _derived(out, peaks_of(samples), root_temporaries(samples, calls))
    for s in out["steps"]:  # key order as in a report
        s.update({key: s.pop(key) for key in list(a["steps"][0]) if key in s})
    out = {key: out[key] for key in a if key != "extrapolated"}
    out["extrapolated"] = {"blocks": n, "module": prefix, "profiled_blocks": list(PROFILED)}
    return Report.from_dict(out)


def _root_calls(runs: dict[int, list[tuple[int, bool, int, int, int]]], n: int) -> list[Any]:
    """The root module's calls at N blocks: step and direction equal in every profile, entry
    level and kept bytes affine in k (the high-water mark comes from the samples)."""
    a, b, c = ([list(x[:4]) for x in runs[k]] for k in PROFILED)
    return _affine((a, b, c), n, "the root module's calls")


__all__ = [
    "PROFILED",
    "NotExtrapolated",
    "extrapolate",
    "extrapolated_samples",
    "peaks_of",
    "root_temporaries",
    "twin_problem",
]
