"""gpumem ckpt: list, verify, inspect, export and import checkpoints (gpumem's own and DCP's)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from gpumem.cli import _args
from gpumem.cli._progress import progress_bar
from gpumem.units import format_bytes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ckpt",
        help="list, verify and inspect checkpoints",
        description="List, verify and inspect checkpoints written by gpumem.Checkpointer.",
    )
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ls = cmds.add_parser(
        "ls", help="list the checkpoints of a directory (manifests checked, data not read)"
    )
    ls.add_argument(
        "dir",
        type=_args.checkpoint_root,
        help="checkpoint directory (holds step-<N>/ and latest), or an s3://BUCKET/PREFIX root "
        "(endpoint and credentials from the AWS environment: AWS_ENDPOINT_URL, AWS_PROFILE, ...)",
    )
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument(
        "--all",
        action="store_true",
        help="s3:// roots: also list incomplete multipart uploads (killed or failed saves)",
    )
    ls.add_argument(
        "--remote",
        metavar="s3://BUCKET/PREFIX",
        help="tiers: the remote of a local directory (Checkpointer(dir, remote=...)); each "
        "step is listed with the tiers holding it (local, remote)",
    )
    ver = cmds.add_parser(
        "verify", help="check every byte of a checkpoint (or of all in a directory)"
    )
    ver.add_argument(
        "path",
        type=_args.checkpoint_root,
        help="a step-<N> directory, a checkpoint directory to verify them all, an "
        "s3://BUCKET/PREFIX root (every committed step) or step (.../step-<N>), or a plain "
        "torch.distributed.checkpoint directory (with .metadata)",
    )
    ver.add_argument(
        "--trust-pickle",
        action="store_true",
        help="read a plain DCP directory's .metadata with plain pickle (runs code: only for "
        "directories you trust) when the restricted reader refuses a class",
    )
    ins = cmds.add_parser(
        "inspect", help="show tensors, sizes, step, versions and saved state of a checkpoint"
    )
    ins.add_argument(
        "path",
        type=_args.checkpoint_root,
        help="a step-<N> directory, a checkpoint directory (its newest), an "
        "s3://BUCKET/PREFIX root (its newest committed step, or --step), or one step of it "
        "(s3://BUCKET/PREFIX/step-<N>, as `ckpt ls` prints it)",
    )
    ins.add_argument("--step", type=_args.non_negative_int, help="s3:// roots: this step")
    ins.add_argument("--json", action="store_true", help="print JSON")
    ins.add_argument(
        "--limit",
        type=_args.non_negative_int,
        default=50,
        help="tensors listed per rank (default 50; 0 = all)",
    )
    exp = cmds.add_parser(
        "export", help="write a checkpoint's model weights as sharded safetensors with an index"
    )
    exp.add_argument(
        "dir",
        type=_args.checkpoint_root,
        help="a checkpoint directory (its newest), a step-<N> directory, or an "
        "s3://BUCKET/PREFIX root (its newest committed step, or --step; read by ranged GETs) "
        "or one step of it (.../step-<N>)",
    )
    exp.add_argument("--step", type=_args.non_negative_int, help="s3:// roots: this step")
    exp.add_argument("--format", choices=["safetensors"], default="safetensors")
    exp.add_argument(
        "--out", required=True, type=_args.new_or_existing_dir, help="output directory"
    )
    exp.add_argument(
        "--config",
        type=_args.existing_path,
        help="a config.json to copy beside the weights (for from_pretrained)",
    )
    exp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating weights")
    exp.add_argument(
        "--max-shard-size",
        type=_args.size,
        default="5GB",
        help="largest safetensors file (default 5GB)",
    )
    imp = cmds.add_parser(
        "import", help="convert a plain torch.distributed.checkpoint directory into gpumem's"
    )
    imp.add_argument(
        "dcp_dir",
        type=_args.checkpoint_dir,
        help="a DCP directory (FileSystemWriter: .metadata, *.distcp)",
    )
    imp.add_argument(
        "out",
        type=_args.new_or_existing_dir,
        help="the gpumem checkpoint directory to create step-<N> in",
    )
    imp.add_argument(
        "--step", type=_args.non_negative_int, default=0, help="the step to record (default 0)"
    )
    imp.add_argument(
        "--trust-pickle",
        action="store_true",
        help="as for verify, and import byte items whose pickles load classes (dcp.load runs "
        "them when it loads them; refused without this flag)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # errors reach main(): one line and exit 2 as for every command; only verify's CORRUPT
    # verdict exits 1
    commands = {
        "ls": _ls,
        "verify": _verify,
        "inspect": _inspect,
        "export": _export,
        "import": _import,
    }
    return commands[args.ckpt_command](args)


def _ls(args: argparse.Namespace) -> int:
    from gpumem.checkpoint import CheckpointError, CheckpointStateError
    from gpumem.checkpoint.storage.directory import list_checkpoints, read_latest, step_dirs
    from gpumem.checkpoint.storage.safe_fs import Dir

    if args.dir.lower().startswith("s3://"):
        if args.remote:
            raise CheckpointStateError(
                "--remote is for a local directory's remote tier; give a directory"
            )
        return _ls_object(args)
    root = Path(args.dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    with Dir.open(root) as d:
        infos = {i.step: i for i in list_checkpoints(d)}
        try:
            ptr = read_latest(d)
        except CheckpointError as exc:
            ptr = None
            print(f"warning: {exc}", file=sys.stderr)
        names = sorted(step_dirs(d))
        aside = _abandoned(d)
    rows = []
    for step, name in names:
        info = infos.get(step)
        rows.append(
            {
                "step": step,
                "path": str(root / name),
                "ok": info is not None,
                "nbytes": info.nbytes if info else None,
                "created": info.created if info else None,
                "world_size": info.world_size if info else None,
                "latest": bool(ptr and ptr["path"] == name),
            }
        )
    if args.remote:
        rows = _with_remote(rows, list(infos), args.remote)
    if not _print_rows(rows, str(root), args.json):
        return 0
    if aside:
        print(
            "\n"
            f"{aside} checkpoint(s) of abandoned branches in "
            f"{root / 'abandoned'} (set aside when training went back; not "
            "restored, not counted by keep): delete them when no longer needed"
        )
    return 0


def _with_remote(rows: list[dict[str, Any]], local: list[int], url: str) -> list[dict[str, Any]]:
    """The local rows and the remote's, one per step, each with the tiers holding it committed
    (a local step whose manifest is damaged is held by neither)."""
    from gpumem.checkpoint.tiers.remote import tier_rows

    remote_rows = {r["step"]: r for r in _object_rows(_object_root(url))}
    held = {
        t.step: t.tiers for t in tier_rows(local, [s for s, r in remote_rows.items() if r["ok"]])
    }
    by_step = {**remote_rows, **{r["step"]: r for r in rows}}
    out = []
    for step in sorted(by_step):
        row = dict(by_step[step], tiers=list(held.get(step, ())))
        if step not in {r["step"] for r in rows}:
            row["latest"] = False  # the local pointer is the one shown
        out.append(row)
    return out


def _ls_object(args: argparse.Namespace) -> int:
    """``ls`` of an s3:// root: its committed steps (manifests checked), ``latest``, and with
    ``--all`` the incomplete uploads."""
    root = _object_root(args.dir)
    rows = _object_rows(root)
    uploads = root.store.uploads() if args.all else []
    if args.json and args.all:  # --all adds a section: the rows alone keep their shape
        found = [{"key": u.key, "upload_id": u.upload_id} for u in uploads]
        print(json.dumps({"checkpoints": rows, "incomplete_uploads": found}, indent=2))
        return 0
    if not _print_rows(rows, root.url, args.json) and not uploads:
        return 0
    for u in uploads:
        print(f"incomplete upload {u.key} (id {u.upload_id[:16]}...): never committed, not read")
    return 0


def _object_rows(root: Any) -> list[dict[str, Any]]:
    """``ls``'s rows of an object root: its committed steps, manifests checked, ``latest``."""
    from gpumem.checkpoint import CheckpointError
    from gpumem.checkpoint.storage.format import LATEST, step_dir_name

    rows = []
    for step in sorted(root.steps()):
        try:
            info = root.open_step(step)[1]
        except CheckpointError:
            info = None
        rows.append(
            {
                "step": step,
                "path": f"{root.url}/{step_dir_name(step)}",
                "ok": info is not None,
                "nbytes": info.nbytes if info else None,
                "created": info.created if info else None,
                "world_size": info.world_size if info else None,
                "latest": False,
            }
        )
    got = root.store.get(root.store.url.key(LATEST), max_bytes=4096)
    if got is not None:
        try:
            pointer = json.loads(got[0])
        except ValueError:
            pointer = None
        for r in rows:
            r["latest"] = isinstance(pointer, dict) and pointer.get("step") == r["step"]
    return rows


def _object_root(url: str) -> Any:
    from gpumem.checkpoint.storage.s3.object_root import ObjectRoot
    from gpumem.checkpoint.storage.s3.object_store import S3Store

    return ObjectRoot(S3Store(url, writable=False))


def _step_url(url: str, step: int | None) -> tuple[str, int | None]:
    """(root, step) of an s3:// URL: one that ends in ``step-<N>`` (as ``ls`` prints a step)
    names that step of its parent root, else ``step`` (``--step``)."""
    from gpumem.checkpoint import CheckpointStateError
    from gpumem.checkpoint.storage.format import STEP_DIR
    from gpumem.checkpoint.storage.location import ObjectURL

    prefix = ObjectURL.parse(url).prefix
    m = STEP_DIR.match(prefix.rsplit("/", 1)[-1]) if prefix else None
    if m is None:
        return url, step
    named = int(m.group(1))
    if step is not None and step != named:
        raise CheckpointStateError(f"{url} is step {named}, but --step {step} was given")
    return url.rstrip("/").rsplit("/", 1)[0], named


def _object_step(url: str, step: int | None) -> tuple[Any, Any]:
    """The committed step ``step`` of an s3:// root or step URL (None: the newest whose
    manifests read): its files (read by ranged GETs) and main manifest."""
    from gpumem.checkpoint import CheckpointCorruptError

    url, step = _step_url(url, step)
    root = _object_root(url)
    steps = root.steps()
    if step is not None:
        if step not in steps:
            raise FileNotFoundError(f"{root.url} has no committed step {step} (it has {steps})")
        return root.open_step(step)
    for s in steps:
        try:
            return root.open_step(s)
        except CheckpointCorruptError as exc:
            print(f"skipping damaged step {s}: {exc}", file=sys.stderr)
    raise FileNotFoundError(f"{root.url} holds no committed checkpoint")


def _print_rows(rows: list[dict[str, Any]], where: str, as_json: bool) -> bool:
    """Print ``ls``'s rows; False when there were none (said so)."""
    if as_json:
        print(json.dumps(rows, indent=2))
        return False
    if not rows:
        print(f"no checkpoints in {where}")
        return False
    print(f"{'step':>10}  {'size':>10}  {'ranks':>5}  {'created (UTC)':<19}  name")
    for r in rows:
        created = (
            dt.datetime.fromtimestamp(r["created"], dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            if r["ok"]
            else "-"
        )
        size = format_bytes(r["nbytes"]) if r["ok"] else "DAMAGED MANIFEST"
        mark = "  <- latest" if r["latest"] else ""
        if "tiers" in r:
            mark += f"  [{', '.join(r['tiers']) or 'no tier: damaged'}]"
        print(
            f"{r['step']:>10}  {size:>10}  {r['world_size'] or '-':>5} "
            f" {created:<19}  {r['path'].rsplit('/', 1)[-1]}{mark}"
        )
    return True


def _abandoned(root: Any) -> int:
    """How many checkpoints ``abandoned/`` holds (real directories only: nothing is followed)."""
    from gpumem.checkpoint.storage.directory import ABANDONED, step_dirs

    try:
        with root.sub(ABANDONED) as aside:
            count = 0
            for e in aside.entries():
                if e.is_dir(follow_symlinks=False):
                    with aside.sub(e.name) as branch:
                        count += len(step_dirs(branch))
            return count
    except OSError:
        return 0


def _targets(path: Path) -> list[Path]:
    from gpumem.checkpoint.storage.directory import step_dirs
    from gpumem.checkpoint.storage.safe_fs import Dir

    if (path / "MANIFEST").exists() or path.name.startswith("step-"):
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    with Dir.open(path) as d:
        found = [path / name for _, name in sorted(step_dirs(d))]
    if not found:
        raise FileNotFoundError(f"{path} holds no checkpoint")
    return found


def _verify(args: argparse.Namespace) -> int:
    from gpumem.checkpoint import CheckpointCorruptError, verify
    from gpumem.checkpoint.interop.dcp_plain import is_plain_dcp, pickled_items, verify_plain

    if args.path.lower().startswith("s3://"):
        return _verify_object(args.path)
    if is_plain_dcp(Path(args.path)):
        try:
            r = verify_plain(Path(args.path), trust_pickle=args.trust_pickle)
        except CheckpointCorruptError as exc:
            print(f"CORRUPT  {args.path}: {exc}")
            return 1
        print(
            f"OK       {args.path}: plain DCP directory, {r.tensors} tensors in {r.chunks} "
            f"chunks and {r.bytes_items} pickled items, {format_bytes(r.nbytes)}\n"
            "         checked: metadata (restricted unpickler), every item's file, offset and "
            "length, tensor records against the metadata (dtype, shape), chunks tiling each "
            "tensor, zip CRC-32 of every record\n"
            "         not checked: DCP stores no checksum of its own (a record rewritten with "
            "its CRC-32), and the pickled items' content (never unpickled here); `gpumem ckpt "
            "import` converts it into a checksummed gpumem checkpoint"
        )
        if r.pickled:
            print(
                f"WARNING  {pickled_items(r, 10)} are pickles that load classes: dcp.load runs "
                "that code when it loads them; `gpumem ckpt import` refuses them without "
                "--trust-pickle"
            )
        return 0
    bad = 0
    targets = _targets(Path(args.path))
    with progress_bar("verifying checkpoints") as bar:
        results = []
        for i, p in enumerate(targets):
            bar(i, len(targets))
            try:
                results.append((p, verify(p), None))
            except CheckpointCorruptError as exc:
                results.append((p, None, exc))
    for p, info, exc in results:
        if info is not None:
            kind = ", replicated state written once" if info.replicated else ""
            print(
                f"OK       {p.name}: step {info.step}, "
                f"{format_bytes(info.nbytes)}, {info.world_size} rank(s){kind}"
            )
        else:
            bad += 1
            print(f"CORRUPT  {p.name}: {exc}")
    return 1 if bad else 0


def _verify_object(url: str) -> int:
    """``verify`` of an s3:// root (every committed step) or of one step's URL: each copied into
    a temporary directory and checked there as a directory is."""
    from gpumem.checkpoint import CheckpointCorruptError
    from gpumem.checkpoint.restore.fetch import verify_step

    url, only = _step_url(url, None)
    root = _object_root(url)
    steps = sorted(root.steps())
    if only is not None:
        if only not in steps:
            raise FileNotFoundError(f"{root.url} has no committed step {only} (it has {steps})")
        steps = [only]
    if not steps:
        raise FileNotFoundError(f"{root.url} holds no committed checkpoint")
    bad = 0
    for step in steps:
        try:
            info = verify_step(root, step)
        except CheckpointCorruptError as exc:
            bad += 1
            print(f"CORRUPT  step {step}: {exc}")
            continue
        print(
            f"OK       step {info.step}: {format_bytes(info.nbytes)}, {info.world_size} "
            f"rank(s), every byte checked"
        )
    return 1 if bad else 0


def _inspect(args: argparse.Namespace) -> int:
    from gpumem.checkpoint.restore.files import open_checkpoint
    from gpumem.checkpoint.storage.directory import load_info, load_shard_manifest

    if args.path.lower().startswith("s3://"):
        step, info = _object_step(args.path, args.step)
        path: Any = step.path
        shards = [(ref, load_shard_manifest(step, info, ref.rank)) for ref in info.shards]
    else:
        path = _targets(Path(args.path))[-1]
        with open_checkpoint(path) as step:
            info = load_info(step)
            shards = [(ref, load_shard_manifest(step, info, ref.rank)) for ref in info.shards]
    ranks = []
    for ref, shard in shards:
        state = shard.state if isinstance(shard.state, dict) else {}
        owned = [
            t for t in shard.tensors if t.name in shard.owners
        ]  # replicated tensors this shard holds
        ranks.append(
            {
                "rank": ref.rank,
                "tensors": len(shard.tensors),
                "nbytes": ref.nbytes,
                "files": shard.files,
                "replicated_tensors": len(owned),
                "replicated_nbytes": sum(t.nbytes for t in owned),
                "chunk_bytes": shard.chunk_bytes,
                "sections": sorted(state),
                "extra": state.get("extra"),
                "tensor_list": [_tensor_json(t) for t in shard.tensors[: args.limit or None]],
            }
        )
    out = {
        "path": str(path),
        "step": info.step,
        "world_size": info.world_size,
        "nbytes": info.nbytes,
        "created": info.created,
        "manifest_crc32c": f"{info.manifest_crc32c:08x}",
        "versions": info.versions,
        "replicated": info.replicated,
        "sharded": info.sharded,
        "ranks": ranks,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    created = dt.datetime.fromtimestamp(info.created, dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )
    print(
        f"{path}\n"
        f"  step {info.step}, {format_bytes(info.nbytes)} of tensors, {info.world_size} "
        f"rank(s), created {created}, manifest crc32c {out['manifest_crc32c']}"
    )
    print("  versions: " + ", ".join(f"{k} {v}" for k, v in info.versions.items()))
    if info.replicated:
        print(
            f"  replicated: model/optimizer/scheduler/scaler tensors written once "
            f"({sum(r['replicated_tensors'] for r in ranks)} tensors, "
            f"{format_bytes(sum(r['replicated_nbytes'] for r in ranks))}), spread over the ranks"
        )
    for r in ranks:
        held = (
            f" ({r['replicated_tensors']} replicated, {format_bytes(r['replicated_nbytes'])})"
            if info.replicated
            else ""
        )
        print(
            f"  rank {r['rank']}: {r['tensors']} tensors{held}, {format_bytes(r['nbytes'])} "
            f"in {len(r['files'])} file(s); state: {', '.join(r['sections'])}"
        )
        if r["extra"] is not None:
            print(f"    extra: {json.dumps(r['extra'])[:200]}")
        for t in r["tensor_list"]:
            block = ""
            if "global" in t:  # a block of a global tensor: where it lies, how it was placed
                g = t["global"]
                spans = ", ".join(
                    f"{o}:{o + n}" for o, n in zip(g["offsets"], t["shape"], strict=True)
                )
                placed = f" ({', '.join(g['placements'])})" if g["placements"] else ""
                block = f"  [{spans}] of {tuple(g['shape'])}{placed}"
            print(
                f"    {t['name']:<48} {t['dtype']:<9} "
                f"{tuple(t['shape'])!s:<18} {format_bytes(t['nbytes']):>10}{block}"
            )
        if args.limit and r["tensors"] > args.limit:
            print(f"    ... {r['tensors'] - args.limit} more (--limit 0 lists all)")
    return 0


def _export(args: argparse.Namespace) -> int:
    from gpumem.checkpoint.interop.export import export_safetensors

    src = args.dir
    if src.lower().startswith("s3://"):
        src = _object_step(src, args.step)[0]
    files = export_safetensors(
        src,
        args.out,
        config=args.config,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
    )
    for f in files:
        print(f)
    return 0


def _import(args: argparse.Namespace) -> int:
    from gpumem.checkpoint.interop.dcp_plain import import_plain

    print(import_plain(Path(args.dcp_dir), Path(args.out), args.step, args.trust_pickle))
    return 0


def _tensor_json(t) -> dict:
    out = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes}
    if t.box is not None:
        out["global"] = {
            "shape": list(t.box.global_shape),
            "offsets": list(t.box.offsets),
            "placements": list(t.placements),
        }
    return out
