"""What regressed between two benchmark runs, beyond the noise.

    python benchmarks/compare.py OLD NEW [--min-change 0.05] [--quiet]

OLD and NEW are each a results file written by a benchmark (``benchmarks/results/<name>.json``), a
directory of them (files are paired by name), or ``REV:PATH`` read from git (``HEAD~3:benchmarks/
results/native.json``; a directory path takes every results file under it at that revision).

The rule. Every figure carries the 20th, 50th and 80th percentiles of its samples; the band
[p20, p80] is that run's noise. A figure **regressed** when both hold:

1. the bands do not overlap, on the worse side: for a figure where lower is better, NEW's p20 lies
   above OLD's p80 (at least 80 % of the new samples are worse than 80 % of the old ones); where
   higher is better, NEW's p80 lies below OLD's p20;
2. the medians moved the worse way by more than ``--min-change`` of OLD's median (default 5 %)
   and by more than the figure's own ``tolerance`` (its unit; 0 unless the benchmark set one).

Rule 2 keeps figures with few or identical samples (one value, a band of width zero) from
flagging every small change. **Improved** is the mirror image; anything else is noise. Figures
only in NEW are listed as new, figures only in OLD as gone; neither fails the comparison.

Runs on different machines or versions are compared all the same, with a warning: absolute figures
(GB/s, ms) then say little, same-run ratios (unit "x") still do.

Exit status: 1 if any figure regressed, 0 otherwise (2: the arguments or files are unusable).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "gpumem-bench/1"
ROOT = Path(__file__).resolve().parent.parent


class UsageError(Exception):
    pass


@dataclass(frozen=True)
class Verdict:
    benchmark: str
    name: str
    unit: str
    kind: str  # "regressed", "improved", "noise", "new", "gone"
    old: dict[str, Any] | None
    new: dict[str, Any] | None

    @property
    def change(self) -> float | None:
        """Relative change of the median, NEW vs OLD (None when not both, or OLD's is 0)."""
        if self.old is None or self.new is None or self.old["p50"] == 0:
            return None
        return (self.new["p50"] - self.old["p50"]) / abs(self.old["p50"])


def judge(old: dict[str, Any], new: dict[str, Any], min_change: float = 0.05) -> str:
    """ "regressed", "improved" or "noise" for one figure measured in two runs (the rule above)."""
    higher = new.get("better", old.get("better", "lower")) == "higher"
    # orient every figure so that larger is worse
    sign = -1.0 if higher else 1.0
    o20, o50, o80 = sorted(sign * old[k] for k in ("p20", "p50", "p80"))
    n20, n50, n80 = sorted(sign * new[k] for k in ("p20", "p50", "p80"))
    floor = max(min_change * abs(old["p50"]), float(new.get("tolerance", 0.0)))
    if n20 > o80 and n50 - o50 > floor:
        return "regressed"
    if n80 < o20 and o50 - n50 > floor:
        return "improved"
    return "noise"


def compare_runs(old: dict[str, Any], new: dict[str, Any], min_change: float) -> list[Verdict]:
    """Every figure of two runs of one benchmark, in NEW's order, then those only in OLD."""
    bench = new.get("benchmark") or old.get("benchmark") or "?"
    olds = {f["name"]: f for f in old["figures"]}
    news = {f["name"]: f for f in new["figures"]}
    out = []
    for name, f in news.items():
        o = olds.get(name)
        kind = "new" if o is None else judge(o, f, min_change)
        out.append(Verdict(bench, name, f["unit"], kind, o, f))
    out += [Verdict(bench, n, f["unit"], "gone", f, None) for n, f in olds.items() if n not in news]
    return out


def _check(doc: Any, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise UsageError(f"{where} is not a benchmark results file (schema {SCHEMA!r})")
    for f in doc.get("figures", []):
        missing = [k for k in ("name", "unit", "p20", "p50", "p80") if k not in f]
        if missing:
            raise UsageError(f"{where}: figure {f.get('name', '?')!r} lacks {missing}")
    return doc


def _git_show(rev: str, path: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True
    )
    if out.returncode:
        raise UsageError(f"git show {rev}:{path} failed: {out.stderr.strip()}")
    return out.stdout


def load_runs(spec: str) -> dict[str, dict[str, Any]]:
    """Results documents named by ``spec`` (file, directory or REV:PATH), keyed by file stem."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        docs = {}
        for f in files:
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError) as exc:
                raise UsageError(f"{f}: {exc}") from None
            if isinstance(doc, dict) and doc.get("schema") == SCHEMA:  # skip other JSON files
                docs[f.stem] = _check(doc, str(f))
        return docs
    if path.is_file():
        try:
            return {path.stem: _check(json.loads(path.read_text()), spec)}
        except ValueError as exc:
            raise UsageError(f"{spec}: {exc}") from None
    rev, sep, rel = spec.partition(":")
    if not sep or not rev:
        raise UsageError(f"{spec}: no such file or directory (nor REV:PATH)")
    rel = rel.rstrip("/")
    listing = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, rel + "/"],
        capture_output=True,
        text=True,
    )
    names = [n for n in listing.stdout.split() if n.endswith(".json")]
    if listing.returncode == 0 and names:  # a directory at that revision
        docs = {}
        for n in names:
            doc = json.loads(_git_show(rev, n))
            if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
                docs[Path(n).stem] = _check(doc, f"{rev}:{n}")
        return docs
    try:
        return {Path(rel).stem: _check(json.loads(_git_show(rev, rel)), spec)}
    except ValueError as exc:
        raise UsageError(f"{spec}: {exc}") from None


def _band(f: dict[str, Any] | None) -> str:
    if f is None:
        return "-"
    return f"{f['p50']:.4g} [{f['p20']:.4g}, {f['p80']:.4g}]"


def _differs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    notes = []
    for part in ("machine", "versions"):
        a, b = old.get(part, {}), new.get(part, {})
        diff = [
            f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
        ]
        if diff:
            notes.append(f"{part} differ: " + "; ".join(diff))
    return notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("old", help="results file, directory or REV:PATH of the earlier run")
    ap.add_argument("new", help="results file, directory or REV:PATH of the later run")
    ap.add_argument(
        "--min-change",
        type=float,
        default=0.05,
        help="smallest relative change of the median that can count (default 0.05)",
    )
    ap.add_argument("--quiet", action="store_true", help="list only regressions and improvements")
    args = ap.parse_args(argv)
    try:
        olds, news = load_runs(args.old), load_runs(args.new)
    except UsageError as exc:
        print(f"compare.py: {exc}", file=sys.stderr)
        return 2
    if len(olds) == 1 and len(news) == 1:  # two files: compare them whatever their names
        pairs = [(next(iter(olds.values())), next(iter(news.values())))]
    else:
        pairs = [(olds[k], news[k]) for k in sorted(set(olds) & set(news))]
        for k in sorted(set(olds) ^ set(news)):
            print(f"{k}: only in {'OLD' if k in olds else 'NEW'}, not compared")
    if not pairs:
        print("compare.py: no results file in both OLD and NEW", file=sys.stderr)
        return 2
    verdicts: list[Verdict] = []
    for old, new in pairs:
        runs = [f"{d.get('git_commit', '?')[:12]} ({d.get('date', '?')})" for d in (old, new)]
        print(f"== {new.get('benchmark')}: {runs[0]} -> {runs[1]}")
        for note in _differs(old, new):
            print(f"   warning: {note}; absolute figures are not comparable, ratios (unit x) are")
        run = compare_runs(old, new, args.min_change)
        verdicts += run
        for v in run:
            if args.quiet and v.kind not in ("regressed", "improved"):
                continue
            change = "" if v.change is None else f"{v.change:+.1%}"
            print(
                f"   {v.kind.upper() if v.kind == 'regressed' else v.kind:<9} {v.name} ({v.unit}): "
                f"{_band(v.old)} -> {_band(v.new)} {change}"
            )
    bad = [v for v in verdicts if v.kind == "regressed"]
    better = sum(v.kind == "improved" for v in verdicts)
    print(
        f"{len(bad)} regressed, {better} improved, "
        f"{sum(v.kind == 'noise' for v in verdicts)} within noise, of {len(verdicts)} figures "
        f"(rule: bands [p20, p80] apart and the median moved > {args.min_change:.0%})"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
