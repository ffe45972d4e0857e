"""The `ckptfs` command: argument parsing, one clear line per error, no tracebacks."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import subprocess
import sys
import time
from typing import Any

from ckptfs import __version__, layout
from ckptfs.errors import CliError
from ckptfs.lifecycle import cmd_mount, cmd_umount, progress
from ckptfs.shared import PUBLISH_BATCH, SharedError

log = logging.getLogger("ckptfs")

SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")


def parse_size(text: str) -> int:
    m = SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 64M, 1G, 4096)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def name_glob(text: str) -> str:
    """A --retain or --marker glob: it matches one file or directory name, never a path."""
    if not text or "/" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a glob for a name, without '/' (checkpoints are found up to three "
            f"levels down by their own name)")
    return text


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    return v


def nonzero_float(text: str) -> float:
    """A positive number of seconds for a loop's period (0 would spin)."""
    v = positive_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0: {text!r}")
    return v


def _whole(text: str, lowest: int, why: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if v < lowest:
        raise argparse.ArgumentTypeError(f"{why}: {text!r}")
    return v


def count(text: str) -> int:
    """A count where 0 means none or off."""
    return _whole(text, 0, "must not be negative")


def positive_int(text: str) -> int:
    return _whole(text, 1, "must be at least 1")


def _count_or_path(text: str) -> int | str:
    """`wait --all-nodes [N] PATH`: argparse hands N the PATH when N is left out; keep it
    (main() moves it back) unless it looks like a number."""
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        if text.lstrip("+-").replace(".", "", 1).isdigit():
            raise
        return text


# --- replay / status --------------------------------------------------------------------

def cmd_replay(a: argparse.Namespace) -> int:
    from ckptfs.daemon import NvmeLock, open_state, read_identity

    nvme = os.path.abspath(a.nvme)
    if not os.path.isdir(os.path.join(nvme, layout.SEGMENT_DIR)):
        raise CliError(f"{nvme} holds no ckptfs log (no {layout.SEGMENT_DIR}/ directory)")
    ident = read_identity(nvme) or {}
    store = None
    shared = a.shared or ident.get("shared")  # where the last mount drained to
    if shared:
        from ckptfs.shared import answers, open_store

        if not shared.startswith("s3://"):
            try:
                answers(shared)
            except SharedError as e:
                raise CliError(f"SHARED {e}; replay reads this node's published segments "
                               f"there") from None
        store = open_store(shared)
        if ident.get("cold"):
            from ckptfs.coldtier import Tiered

            store = Tiered(store, open_store(ident["cold"]))
    lock = NvmeLock(nvme)
    lock.acquire()
    try:
        index, seglog, rep = open_state(
            nvme, ident.get("node", "replay"), 256 << 20, full_replay=not a.tail, store=store,
            first_seg=ident.get("first_segment") if store is not None else None,
            dir_id=int(ident.get("created_ns", 0)))
        index.close(commit=True)
        seglog.close()
        from ckptfs.recovery import repair_published_view

        try:
            view = repair_published_view(nvme)
        except ValueError as e:
            raise CliError(str(e)) from None
    finally:
        lock.release()
    d = rep.as_dict()
    d["published_view"] = view
    d["log_bytes_per_s"] = round(rep.bytes_scanned / rep.seconds) if rep.seconds else None
    if a.json:
        print(json.dumps(d, indent=2))
    else:
        print(f"replayed {rep.records} records from {rep.segments_replayed} of {rep.segments} "
              f"segments ({rep.bytes_scanned / 1e6:.1f} MB) in {rep.seconds:.2f}s"
              + (" starting from the index snapshot" if rep.from_snapshot else ""))
        print(f"namespace: {rep.files} files ({rep.file_bytes / 1e6:.1f} MB), "
              f"{rep.directories} directories")
        if rep.torn_tail:
            print(f"torn tail: {rep.torn_tail}")
        if rep.recovered_tail:
            print(f"recovered: {rep.recovered_tail}")
        for c in rep.corruption:
            print(f"CORRUPTION: {c}")
        if view:
            print(view)
    return 1 if rep.corruption else 0


def cmd_status(a: argparse.Namespace) -> int:
    from ckptfs import control

    def fetch(refresh: bool) -> dict:
        try:
            sock, _ = control.find_socket(a.path)
            return control.request(sock, {"op": "status", "refresh": refresh},
                                   timeout=60)["status"]
        except control.ControlError as e:
            raise CliError(str(e)) from None

    st = fetch(a.refresh)
    if a.json and not a.watch:
        print(json.dumps(st, indent=2))
        return 0
    from rich.console import Console

    if not a.watch:
        Console().print(_status_table(st))
        return 0
    from rich.live import Live

    try:
        with Live(_status_table(st), refresh_per_second=2, screen=False) as live:
            while True:
                time.sleep(a.interval)
                live.update(_status_table(fetch(False)))
    except KeyboardInterrupt:
        return 0


def _status_table(st: dict) -> Any:
    from rich.table import Table

    ro = ", read-only" if st.get("read_only") else ""
    t = Table(title=f"ckptfs {st['mountpoint']} (node {st['node_id']}{ro}, pid {st['pid']})",
              show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    rate = st.get("upload_rate_bytes_s") or 0
    pending = max(0, st.get("bytes_pending_upload", 0))
    eta = f"{pending / rate:.0f}s" if rate else ("-" if pending else "0s")
    rows = [
        ("written", _human(st["bytes_written"])),
        ("pending upload", f"{_human(pending)} (ETA {eta})"),
        ("uploaded", f"{_human(st['bytes_uploaded'])} at {_human(rate)}/s"),
        ("segments", ", ".join(f"{k} {v}" for k, v in sorted(st["segments"].items())) or "-"),
        ("local disk", f"{_human(st['local_bytes_used'])} used by ckptfs, "
                       f"{_human(st['local_bytes_free'])} free, cache {st['cache']['state']}"),
        ("fsyncs", f"{st['fsync_calls']} ({st['device_flushes']} device flushes)"),
        ("shared-store ops", ", ".join(f"{k} {v}" for k, v in sorted(st["shared_ops"].items()))
         or "-"),
        ("checkpoints", ", ".join(c["name"] + ("" if c["complete"] else "*")
                                  for c in st["retention"]["checkpoints"]) or "-"),
        ("last error", (f"{st['last_error']} (failing for {st.get('failing_for_s', 0):.0f} s)"
                        if st["last_error"] else "none")),
    ]
    if st.get("log_error"):
        rows.insert(0, ("LOG FAILED", f"a flush of the log on NVMe failed ({st['log_error']}): "
                                      f"writes fail with EIO; unmount, check the disk, mount "
                                      f"again"))
    if st.get("damaged_records"):
        found = (st.get("replay") or {}).get("corruption") or []
        rows.append(("DAMAGED", f"{st['damaged_records']} records on this node read EIO unless "
                                f"SHARED has a good copy" + (f"; replay: {found[0]}" + (
                                    f" (and {len(found) - 1} more)" if len(found) > 1 else "")
                                    if found else "")))
    stall = st.get("shared_stalled_s") or 0
    if stall >= 2:  # a daemon from before this field has none
        rows.append(("shared store", f"no answer for {stall:.0f} s"
                     + (f" (waiting: {st['shared_stalled_on']})"
                        if st.get("shared_stalled_on") else "")))
    for k, v in rows:
        t.add_row(k, str(v))
    return t


def _control(path: str, req: dict, timeout: float = 600) -> dict:
    from ckptfs import control

    try:
        sock, _ = control.find_socket(path)
        return control.request(sock, req, timeout=timeout)
    except control.ControlError as e:
        raise CliError(str(e)) from None


def cmd_evict(a: argparse.Namespace) -> int:
    r = _control(a.path, {"op": "evict", "all": a.all})
    print(f"evicted {r['evicted']} published segments from local disk")
    return 0


def cmd_gc(a: argparse.Namespace) -> int:
    r = _control(a.path, {"op": "gc", "compact": a.compact})
    print(f"retention deleted {len(r['deleted_checkpoints'])} checkpoints; "
          f"{r['segments_freed']} segments freed; {r['compacted_bytes']:,} bytes compacted")
    if r.get("skipped"):
        raise CliError(f"garbage collection did not run: {r['skipped']}")
    return 0


def cmd_wait(a: argparse.Namespace) -> int:
    from ckptfs import api

    try:
        os.stat(a.path)
    except FileNotFoundError:
        raise CliError(f"{a.path}: no such file or directory") from None
    except OSError:
        pass  # a dead mount (ENOTCONN) or no access: find_socket says which
    try:
        with progress(f"waiting for {a.path}") as update:
            seq = api.wait(a.path, timeout=a.timeout, on_progress=update)
    except TimeoutError as e:
        raise CliError(f"{a.path}: {e}") from None
    except api.CkptfsError as e:
        raise CliError(str(e)) from None
    if a.all_nodes:
        _wait_all_nodes(a)
    if not a.quiet:
        print(f"{a.path}: published (log sequence {seq})")
    return 0


def _wait_all_nodes(a: argparse.Namespace) -> None:
    """After our own part is published: until N nodes' manifests say their own `wait` of
    the checkpoint (or of a directory above it) began, so each has published all it wrote
    there, and its marker is there (read from SHARED, like any other node would)."""
    from ckptfs import api
    from ckptfs.export import checkpoints, merged_view, top_marker_targets
    from ckptfs.retention import checkpoint_of
    from ckptfs.shared import bounded, open_store

    st = api.status(a.path)
    need = a.all_nodes if a.all_nodes > 0 else int(st.get("nodes_required") or 0)
    if need <= 0:
        raise CliError("--all-nodes needs a node count: mount with --nodes N or pass "
                       "--all-nodes N")
    from ckptfs import control

    _sock, rel = control.find_socket(a.path)
    store = open_store(st["shared"])
    ret = tuple(st.get("retain") or ()) or ("*",)
    marks = tuple(st.get("markers") or ())
    # the checkpoint PATH is or lies in; else its top-level directory counts as one
    top = checkpoint_of(rel, ret, True) or rel.split("/", 1)[0]
    ret += (top.rsplit("/", 1)[-1],)
    deadline = None if a.timeout is None else time.monotonic() + a.timeout

    def look() -> Any:
        view = merged_view(store)
        return {c.name: c for c in checkpoints(view, ret, marks, need,
                                               top_marker_targets(store, view, ret))}.get(top)

    while True:
        # a hung NAS would block a look forever; one started before the deadline may end
        # after it (it takes milliseconds), one that takes 10 s past it is stuck
        try:
            c = bounded(look, None if deadline is None
                        else max(0.0, deadline - time.monotonic()) + 10)
        except TimeoutError:
            raise CliError(f"{a.path}: timed out waiting for all nodes (still reading the "
                           f"shared store: a hung NAS?)") from None
        if c is not None and c.marker and len(c.waited) >= need:
            return
        if deadline is not None and time.monotonic() > deadline:
            have = len(c.waited) if c else 0
            raise CliError(f"{a.path}: timed out waiting for all nodes ({have}/{need} "
                           f"nodes' waits published, marker {'yes' if c and c.marker else 'no'})")
        time.sleep(1.0)


def _open_store(path: str) -> Any:
    from ckptfs.export import check_store

    try:
        return check_store(path)
    except SharedError as e:
        raise CliError(str(e)) from None


def cmd_ls(a: argparse.Namespace) -> int:
    from ckptfs.export import (ExportError, checkpoints, merged_view, select,
                               top_marker_targets)
    from ckptfs.retention import DEFAULT_MARKERS, DEFAULT_RETAIN

    store = _open_store(a.shared)
    try:
        view = merged_view(store)
    except ExportError as e:
        raise CliError(str(e)) from None
    for err in view.errors:
        print(f"ckptfs: warning: ignoring {err}", file=sys.stderr)
    if not a.path and not a.files:
        retain = tuple(a.retain or DEFAULT_RETAIN)
        named = top_marker_targets(store, view, retain)
        cps = checkpoints(view, retain, tuple(a.marker or DEFAULT_MARKERS), a.nodes, named)
        # a run whose `latest` names its newest checkpoint: the older ones have no marker of
        # their own, and ls cannot know whether `latest` named them before (docs/cli.md)
        named_in = {os.path.dirname(n): os.path.basename(n) for n in named}
        if a.json:
            print(json.dumps([c.__dict__ for c in cps], indent=1))
            return 0
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"checkpoints on {a.shared}", show_lines=False)
        for col in ("checkpoint", "files", "size", "nodes", "tier", "state"):
            t.add_column(col, justify="right" if col in ("files", "size") else "left")
        for c in cps:
            state = "complete" if c.complete else (
                f"incomplete ({len(c.nodes)}/{a.nodes} nodes)" if c.marker else
                f"no marker (the tracker names {named_in[os.path.dirname(c.name)]})"
                if os.path.dirname(c.name) in named_in else "incomplete (no marker)")
            t.add_row(c.name, str(c.files), _human(c.bytes), ",".join(c.nodes),
                      "+".join(sorted(c.tiers)) or "-", state)
        Console().print(t)
        holding = {c.name.split("/", 1)[0] for c in cps}
        others = sum(1 for p in view.entries if "/" not in p and p not in holding)
        if others:
            print(f"({others} other top-level entries; `ckptfs ls {a.shared} --files` lists "
                  f"everything)")
        return 0
    rows = list(select(view, a.path or ""))
    if a.path and not rows:
        raise CliError(f"nothing published under {a.path!r}")
    if a.json:
        print(json.dumps([{"path": e.path, "type": e.type, "size": e.size, "node": node,
                           "mtime_ns": e.mtime_ns} for _r, node, e in rows], indent=1))
        return 0
    for _rel, node, e in rows:
        kind = {"d": "dir ", "f": "file", "l": "link"}[e.type]
        size = f"{e.size:>14,}" if e.type == "f" else " " * 14
        print(f"{kind} {size}  {node:<12} {e.path}" + (f" -> {e.target}" if e.target else ""))
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_export(a: argparse.Namespace) -> int:
    from ckptfs.export import ExportError, export

    store = _open_store(a.shared)
    unmarked: list[str] = []
    try:
        with progress(f"exporting {a.path}") as update:
            files, nbytes = export(
                store, a.path, a.dest, progress=lambda d, t: update({"done": d, "total": t}),
                warn=lambda msg: print(f"ckptfs: warning: ignoring {msg}", file=sys.stderr),
                unmarked=unmarked.extend)
    except ExportError as e:
        raise CliError(str(e)) from None
    print(f"exported {files} files ({nbytes:,} bytes) to {a.dest}")
    if unmarked:  # after the export: a failure says one line, not this as well
        more = f" and {len(unmarked) - 3} more" if len(unmarked) > 3 else ""
        print(f"ckptfs: warning: no commit marker published for {', '.join(unmarked[:3])}"
              f"{more}: may be incomplete (`ckptfs ls {a.shared}`)", file=sys.stderr)
    return 0


def cmd_fsck(a: argparse.Namespace) -> int:
    from ckptfs.fsck import fsck

    store = _open_store(a.shared)
    rep = fsck(store, deep=a.deep)
    if a.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        print(f"{rep.nodes} nodes, {rep.manifests} manifests, {rep.files} files, "
              f"{rep.objects} objects" + (f", {rep.bytes_verified:,} bytes verified"
                                          if a.deep else ""))
        if rep.unreferenced:
            print(f"{len(rep.unreferenced)} objects referenced by no manifest")
        for p in rep.problems:
            print(f"PROBLEM: {p}")
        print("ok" if not rep.problems else f"{len(rep.problems)} problems")
    return 1 if rep.problems else 0


def cmd_plan(a: argparse.Namespace) -> int:
    from ckptfs import plan

    try:
        p = plan.make_plan(plan.parse_bytes(a.size), plan.parse_seconds(a.interval),
                           plan.parse_seconds(a.budget), a.ranks, a.files_per_rank, a.nodes,
                           plan.parse_bytes(a.segment_size), a.keep_local, a.keep_shared,
                           a.nas_creates, plan.parse_bytes(a.nas_bandwidth)
                           if a.nas_bandwidth else None, a.publish_batch)
    except ValueError as e:
        raise CliError(str(e)) from None
    if a.json:
        print(json.dumps(plan.as_dict(p), indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    gb = 1e9
    t = Table(title="ckptfs plan", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    rows = [
        ("checkpoint / interval / budget",
         f"{p.checkpoint_bytes / gb:.1f} GB / {p.interval_s:.0f}s / {p.budget_s:.0f}s"),
        ("1. files per checkpoint", f"{p.files:,}"),
        ("2. required bandwidth (peak ~2.5x)",
         f"{p.required_bandwidth / gb:.2f} GB/s ({p.peak_bandwidth / gb:.2f})"),
        ("2. metadata ops in the budget", f"{p.metadata_ops:,} ({p.metadata_ops_per_s:,.0f}/s)"),
    ]
    if p.nas_metadata_seconds is not None:
        rows.append(("3. straight to NAS: metadata time", f"{p.nas_metadata_seconds:.1f}s"))
    if p.nas_data_seconds is not None:
        rows.append(("3. straight to NAS: data time", f"{p.nas_data_seconds:.1f}s"))
    rows += [
        ("ckptfs: NVMe write bandwidth per node", f"{p.nvme_bandwidth_per_node / gb:.2f} GB/s"),
        ("ckptfs: shared objects per checkpoint", f"{p.segments:,}"),
        ("ckptfs: shared namespace ops", f"{p.shared_ops:,}"),
        ("ckptfs: shared bandwidth (over the interval)", f"{p.shared_bandwidth / gb:.3f} GB/s"),
        ("ckptfs: local capacity per node", f"{p.local_capacity_per_node / gb:.1f} GB"),
        ("ckptfs: shared capacity (keep-shared)", f"{p.shared_capacity / gb:.1f} GB"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    print(p.verdict)
    return 0


def cmd_probe(a: argparse.Namespace) -> int:
    from ckptfs import probe

    try:
        r = probe.probe(a.dir, seconds=a.seconds, max_bytes=a.max_bytes)
    except FileNotFoundError:
        raise CliError(f"{a.dir}: no such directory") from None
    except NotADirectoryError:
        raise CliError(f"{a.dir}: not a directory") from None
    if a.json:
        print(json.dumps(probe.as_dict(r), indent=2))
        return 0
    print(f"{r.directory}: {r.creates_per_s:,.0f} creates/s, fsync p50 "
          f"{r.fsync_latency_ms_p50:.2f} ms p99 {r.fsync_latency_ms_p99:.2f} ms, "
          f"write {r.write_bandwidth / 1e6:,.0f} MB/s, read {r.read_bandwidth / 1e6:,.0f} MB/s")
    print(f"feed to plan: --nas-creates {r.creates_per_s:.0f} "
          f"--nas-bandwidth {r.write_bandwidth / 1e6:.0f}MB/s")
    return 0


# --- the parser -------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    # No abbreviated options: `--keep 3` would mean --keep-local today and be refused the
    # day another --keep-* option is added; a script must say what it means.
    p = argparse.ArgumentParser(
        prog="ckptfs", allow_abbrev=False,
        description="A checkpoint filesystem: writes land in a log on local NVMe and drain to "
                    "shared storage as a few big objects.")
    p.add_argument("--version", action="version", version=f"ckptfs {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND",
                           parser_class=functools.partial(argparse.ArgumentParser,
                                                          allow_abbrev=False))
    sub.required = True

    m = sub.add_parser("mount", help="mount ckptfs at MOUNTPOINT",
                       description="Mount ckptfs. Without --foreground, returns once the mount "
                                   "is usable and leaves the daemon in the background.")
    m.add_argument("nvme", metavar="NVME", help="directory on fast local disk (log + index)")
    m.add_argument("shared", metavar="SHARED", help="directory on the shared NAS / parallel FS")
    m.add_argument("mountpoint", metavar="MOUNTPOINT", help="where training writes checkpoints")
    m.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground")
    m.add_argument("--node-id", help="this node's name on the shared store (default: hostname)")
    m.add_argument("--read-only", "--ro", action="store_true",
                   help="a node that only reads what the others publish (evaluation, "
                        "inference): writes fail with EROFS, nothing is published or deleted "
                        "on SHARED, which may be mounted read-only; needs its own --node-id")
    m.add_argument("--segment-size", type=parse_size, default=256 << 20,
                   help="seal a log segment at this size (default 256M)")
    m.add_argument("--seal-idle", type=nonzero_float, default=5.0,
                   help="seal a segment idle for this many seconds (default 5)")
    m.add_argument("--upload-streams", type=int, default=None,
                   help="parallel drain streams (default 4 to a directory, 2 to S3, whose "
                        "streams each hold 64 MiB parts in memory)")
    m.add_argument("--publish-batch", type=int, default=PUBLISH_BATCH, metavar="N",
                   help="publish up to N waiting segments at once as one batch directory on "
                        f"SHARED: N + 2 namespace operations instead of 2N (default "
                        f"{PUBLISH_BATCH}; 1 = one object at a time)")
    m.add_argument("--upload-limit", type=positive_float, default=0.0,
                   help="drain bandwidth cap in MB/s (0 = none)")
    m.add_argument("--drain-policy", choices=["yield", "always"], default="yield",
                   help="yield: uploads pause while the application writes fast (the save "
                        "gets the disk and CPU first) unless someone waits or space runs "
                        "short; always: drain concurrently (default yield)")
    m.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on this port (0 = off)")
    m.add_argument("--high-watermark", type=float, default=0.85,
                   help="evict published segments above this NVMe usage (default 0.85)")
    m.add_argument("--low-watermark", type=float, default=0.70,
                   help="...until usage is below this (default 0.70)")
    m.add_argument("--cache-size", type=parse_size, default=0,
                   help="cap on local segment bytes, e.g. 50G (default: the filesystem)")
    m.add_argument("--enospc-timeout", type=positive_float, default=60.0,
                   help="writers wait this long for space before ENOSPC (default 60)")
    m.add_argument("--refresh-interval", type=nonzero_float, default=5.0,
                   help="seconds between reads of other nodes' manifests (default 5)")
    m.add_argument("--retain", action="append", metavar="GLOB", type=name_glob,
                   help="names of the directories that are checkpoints, up to three levels "
                        "down, counted per run directory (repeatable; default step_*, "
                        "step-*, checkpoint-*, global_step*, iter_*)")
    m.add_argument("--marker", action="append", metavar="GLOB", type=name_glob,
                   help="commit marker file names (repeatable; default .metadata, "
                        "trainer_state.json, commit_success.txt, latest)")
    m.add_argument("--keep-local", type=count, default=0, metavar="N",
                   help="keep the newest N checkpoints of each run on NVMe, evict older ones "
                        "once published (default 0: watermarks only)")
    m.add_argument("--keep-shared", type=count, default=0, metavar="M",
                   help="keep the newest M complete checkpoints of each run, delete older "
                        "ones from the namespace and SHARED (default 0: keep all)")
    m.add_argument("--cold", metavar="URL",
                   help="cold tier (directory or s3:// URL): checkpoints older than the "
                        "newest --keep-shared move there instead of being deleted")
    m.add_argument("--keep-cold", type=count, default=0, metavar="K",
                   help="keep K checkpoints on the cold tier, delete older ones (default 0: all)")
    m.add_argument("--nodes", type=count, default=0, metavar="N",
                   help="checkpoints are written by N nodes: complete only when all N "
                        "published (used by `wait --all-nodes`)")
    m.add_argument("--no-dedup", action="store_true",
                   help="write and upload every chunk even if identical bytes were already "
                        "written (the incremental drain is on by default)")
    m.add_argument("--gc-grace", type=positive_float, default=60.0,
                   help="seconds an object stays unreferenced before it is deleted (default 60)")
    m.add_argument("--allow-other", action="store_true",
                   help="let other users use the mount (permissions enforced as on ext4)")
    m.add_argument("--default-permissions", action="store_true",
                   help="keep the kernel's permission checks on a mount by root without "
                        "--allow-other too (only root can use it, and root passes them but "
                        "for execute bits, which ckptfs checks itself; they cost each create "
                        "a round trip; keep them for root processes without "
                        "CAP_DAC_OVERRIDE)")
    m.add_argument("--fsname", default="ckptfs",
                   help="the mount's source as /proc/mounts, df and findmnt show it "
                        "(default ckptfs; mount.ckptfs passes NVME:SHARED)")
    m.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    m.add_argument("--log-file", help="log here instead of stderr (background: NVME/ckptfs.log)")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="drain, then unmount and stop the daemon")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.add_argument("--no-drain", action="store_true", help="unmount without draining first")
    u.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds to wait for the drain and the daemon (default 600)")
    u.set_defaults(func=cmd_umount)

    r = sub.add_parser("replay", help="offline: rebuild the index from the log and report",
                       description="Rebuild NVME's index from its log (no daemon may be "
                                   "running on NVME). Exit 1 if corruption was found.")
    r.add_argument("nvme", metavar="NVME")
    r.add_argument("--shared", metavar="SHARED",
                   help="the shared store: segments evicted from NVME are replayed from it "
                        "(default: the one NVME was last mounted with)")
    r.add_argument("--tail", action="store_true",
                   help="only replay beyond the index's last commit (what a mount does)")
    r.add_argument("--json", action="store_true", help="machine-readable report")
    r.set_defaults(func=cmd_replay)

    s = sub.add_parser("status", help="what the daemon is doing")
    s.add_argument("path", metavar="PATH", help="the mount point or any path inside it")
    s.add_argument("--json", action="store_true", help="every counter, as JSON")
    s.add_argument("--watch", action="store_true", help="a live view, updated every second")
    s.add_argument("--interval", type=positive_float, default=1.0, help=argparse.SUPPRESS)
    s.add_argument("--refresh", action="store_true",
                   help="re-read other nodes' manifests from the shared store first")
    s.set_defaults(func=cmd_status)

    w = sub.add_parser("wait", help="block until PATH is published on the shared store")
    w.add_argument("path", metavar="PATH", nargs="?",
                   help="a file or directory inside a ckptfs mount")
    w.add_argument("--timeout", type=positive_float, help="give up after this many seconds")
    w.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    w.add_argument("--all-nodes", nargs="?", type=_count_or_path, const=-1, default=0,
                   metavar="N",
                   help="also wait until N nodes (default: the mount's --nodes) published "
                        "their parts of the checkpoint and its marker")
    w.set_defaults(func=cmd_wait)

    ev = sub.add_parser("evict", help="drop local copies of published segments now")
    ev.add_argument("path", metavar="MOUNTPOINT")
    ev.add_argument("--all", action="store_true",
                    help="every published segment (default: down to the low watermark)")
    ev.set_defaults(func=cmd_evict)

    g = sub.add_parser("gc", help="run retention and garbage collection now (no grace)")
    g.add_argument("path", metavar="MOUNTPOINT")
    g.add_argument("--compact", action="store_true", help="also compact mostly-dead segments")
    g.set_defaults(func=cmd_gc)

    ls = sub.add_parser("ls", help="what is published on SHARED (no mount needed)")
    ls.add_argument("shared", metavar="SHARED")
    ls.add_argument("path", metavar="PATH", nargs="?", default="",
                    help="a published directory (default: the checkpoints table)")
    ls.add_argument("--json", action="store_true", help="print as JSON")
    ls.add_argument("--files", action="store_true", help="list every published entry")
    ls.add_argument("--nodes", type=count, default=0, metavar="N",
                    help="a checkpoint is complete only when its files hold data of N nodes")
    ls.add_argument("--retain", action="append", metavar="GLOB", type=name_glob,
                    help="checkpoint directory name globs (default step_*, step-*, "
                         "checkpoint-*, global_step*, iter_*)")
    ls.add_argument("--marker", action="append", metavar="GLOB", type=name_glob,
                    help="commit marker globs")
    ls.set_defaults(func=cmd_ls)

    e = sub.add_parser("export", help="copy published files out as plain files (no mount, "
                                      "no local state needed)")
    e.add_argument("shared", metavar="SHARED")
    e.add_argument("path", metavar="PATH", help="published path, e.g. step_1000")
    e.add_argument("dest", metavar="DEST", help="directory to write into")
    e.set_defaults(func=cmd_export)

    from ckptfs import demo

    d = sub.add_parser("demo", help="mount a temporary ckptfs, write a simulated multi-rank "
                                    "checkpoint, drain it, verify, clean up")
    demo.add_arguments(d)
    d.set_defaults(func=demo.main)

    pl = sub.add_parser("plan", help="size storage for a checkpoint workload (the seed's "
                                     "three steps)")
    pl.add_argument("--size", required=True, help="checkpoint size, e.g. 50GB")
    pl.add_argument("--interval", required=True, help="time between checkpoints, e.g. 10m")
    pl.add_argument("--budget", required=True, help="allowed save time, e.g. 30s")
    pl.add_argument("--ranks", type=int, required=True, help="writing processes in total")
    pl.add_argument("--files-per-rank", type=int, default=1,
                    help="files each rank writes per checkpoint (default 1)")
    pl.add_argument("--nodes", type=count, default=1,
                    help="machines the ranks run on, each with its own NVMe and mount; "
                         "per-node figures divide by it (default 1)")
    pl.add_argument("--segment-size", default="256MiB",
                    help="the mount's --segment-size (default 256MiB)")
    pl.add_argument("--keep-local", type=count, default=2,
                    help="checkpoints kept on NVMe (the mount's --keep-local; default 2)")
    pl.add_argument("--keep-shared", type=count, default=5,
                    help="checkpoints kept on the shared store (default 5)")
    pl.add_argument("--nas-creates", type=float, help="NAS creates/s (from `ckptfs probe`)")
    pl.add_argument("--nas-bandwidth", help="NAS write bandwidth, e.g. 2GB/s")
    pl.add_argument("--publish-batch", type=int, default=PUBLISH_BATCH, metavar="N",
                    help=f"the mount's --publish-batch (default {PUBLISH_BATCH})")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    pr = sub.add_parser("probe", help="measure a directory's create rate, fsync latency and "
                                      "bandwidth (bounded, cleans up)")
    pr.add_argument("dir", metavar="DIR")
    pr.add_argument("--seconds", type=nonzero_float, default=2.0,
                    help="time per measurement (default 2)")
    pr.add_argument("--max-bytes", type=parse_size, default=256 << 20,
                    help="largest file written (default 256M)")
    pr.add_argument("--json", action="store_true", help="print the figures as JSON")
    pr.set_defaults(func=cmd_probe)

    f = sub.add_parser("fsck", help="verify published manifests and objects")
    f.add_argument("shared", metavar="SHARED")
    f.add_argument("--deep", action="store_true", help="verify every record's checksum")
    f.add_argument("--json", action="store_true", help="machine-readable report")
    f.set_defaults(func=cmd_fsck)
    return p


# options mount(8) passes that mean nothing to ckptfs
_MOUNT_NOOP = {"rw", "defaults", "auto", "noauto", "user", "nouser", "_netdev", "nofail",
               "x-systemd.automount", "suid", "nosuid", "dev", "nodev", "exec", "noexec"}


def mount_helper(argv: list[str] | None = None) -> int:
    """`mount.ckptfs NVME:SHARED MOUNTPOINT [-o opts]`: what mount(8) runs for an fstab line

        /nvme/ckpt:/mnt/shared  /ckpt  ckptfs  node_id=n0,keep_shared=5,_netdev  0 0

    Options map to `ckptfs mount` flags (node_id=n0 -> --node-id n0, allow_other ->
    --allow-other); mount(8)'s generic ones are ignored.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    opts: list[str] = []
    pos: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "-o" and i + 1 < len(args):
            opts += args[i + 1].split(",")
            i += 2
            continue
        if args[i] in ("-n", "-s", "-f", "-v"):  # mount(8) helper flags we can ignore
            i += 1
            continue
        pos.append(args[i])
        i += 1
    if "remount" in opts and len(pos) >= 1:
        # `mount -o remount,ro /ckpt`: nothing for the daemon to do; the kernel flips the
        # mount's read-only flag (FUSE accepts ro/rw on a remount). -i: not back to us.
        flags = [o for o in opts if o in ("remount", "ro", "rw")]
        return subprocess.call(["mount", "-i", "-o", ",".join(flags), pos[-1]])
    if len(pos) != 2 or ":" not in pos[0]:
        print("ckptfs: error: usage: mount.ckptfs NVME:SHARED MOUNTPOINT [-o options]",
              file=sys.stderr)
        return 2
    nvme, shared = pos[0].split(":", 1)
    cmd = ["mount", nvme, shared, pos[1], "--fsname", pos[0]]
    for o in opts:
        if not o or o in _MOUNT_NOOP or o.startswith("x-") or o.startswith("comment="):
            continue
        k, _, v = o.partition("=")
        cmd.append("--" + k.replace("_", "-"))
        if v:
            cmd.append(v)
    return main(cmd)


class _CliFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"ckptfs: {record.levelname.lower()}: {record.getMessage()}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.func is cmd_wait:
        if isinstance(a.all_nodes, str):  # `wait --all-nodes PATH`: that was PATH, not N
            if a.path is not None:
                parser.error(f"argument --all-nodes: not a whole number: {a.all_nodes!r}")
            a.path, a.all_nodes = a.all_nodes, -1
        if a.path is None:
            parser.error("wait: the following arguments are required: PATH")
    if not logging.getLogger().handlers:  # `ckptfs: warning: ...`, as the CLI's own lines
        handler = logging.StreamHandler()
        handler.setFormatter(_CliFormatter())
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
    try:
        return int(a.func(a) or 0)
    except CliError as e:
        print(f"ckptfs: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ckptfs: error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1  # the reader of our output went away (`ckptfs ls | head`)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"ckptfs: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
