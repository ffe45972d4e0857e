"""`ckptfs demo`: the whole story on a built-in default, in a throwaway directory.

Mount ckptfs on temporary NVME/SHARED/MNT directories, let `ranks` real processes write a
DCP-style checkpoint storm (`step_100/__{rank}_{i}.distcp`, each file fsync'd, rank 0 writing
`.metadata` last, as torch.distributed.checkpoint does), time what training sees, wait for the
drain with a progress bar, write the same storm straight into a plain directory for comparison,
verify every byte through `ckptfs export`, print a before/after table and take it all down.

Everything goes through the CLI (`python -m ckptfs ...`), as a user would type it. Cleanup runs
whatever happened (failure, Ctrl-C): unmount, and if that fails `fusermount3 -uz` plus a kill of
the daemon this demo started, then removal of every directory it made.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ckptfs import layout

STEP = "step_100"
# Every file of a rank is a window of one random buffer, each starting this many bytes further
# in: files differ at every offset (a misplaced extent cannot go unnoticed) while a rank holds
# only size + files * STRIDE bytes instead of files * size. The stride is odd, so no write of
# one file repeats a write of another and ckptfs's write-level dedup finds nothing to skip:
# the demo moves every byte it claims to.
STRIDE = 65_537
STORM_TIMEOUT = 600.0


def _ckptfs(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptfs", *args]


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (the terminal closed): clean up exactly as for Ctrl-C."""


def _raise_terminated(signum: int, _frame: Any) -> None:
    raise _Terminated(signal.Signals(signum).name)


@contextlib.contextmanager
def _termination_is_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _ignored(*sigs: signal.Signals) -> Iterator[None]:
    """These signals ignored (and so, for programs started meanwhile, too)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# --- the ranks (spawned processes) --------------------------------------------------------

def _rank_blobs(rank: int, nfiles: int, size: int) -> tuple[memoryview, list[str]]:
    buf = random.Random(0xC0FFEE + rank).randbytes(size + (nfiles - 1) * STRIDE)
    view = memoryview(buf)
    sums = [xxhash.xxh3_128_hexdigest(view[i * STRIDE:i * STRIDE + size]) for i in range(nfiles)]
    return view, sums


def _write_file(path: str, data: memoryview | bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)  # what torch.distributed.checkpoint's FileSystemWriter does per file
    finally:
        os.close(fd)


def _metadata(ranks: int, nfiles: int, size: int) -> bytes:
    files = {f"__{r}_{i}.distcp": size for r in range(ranks) for i in range(nfiles)}
    return json.dumps({"format": "ckptfs-demo", "step": 100, "files": files}).encode()


def _rank_main(rank: int, ranks: int, nfiles: int, size: int, jobs: Any, results: Any,
               start: Any, shards_done: Any) -> None:
    # Ctrl-C reaches the whole process group; the parent decides and terminates us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        view, sums = _rank_blobs(rank, nfiles, size)
        meta = _metadata(ranks, nfiles, size) if rank == 0 else b""
        if rank == 0:
            sums.append(xxhash.xxh3_128_hexdigest(meta))
        results.put(("ready", rank, sums))
        while True:
            step_dir = jobs.get()
            if step_dir is None:
                return
            start.wait(STORM_TIMEOUT)
            t0 = time.monotonic()
            os.makedirs(step_dir, exist_ok=True)
            for i in range(nfiles):
                _write_file(os.path.join(step_dir, f"__{rank}_{i}.distcp"),
                            view[i * STRIDE:i * STRIDE + size])
            shards_done.wait(STORM_TIMEOUT)
            if rank == 0:  # the coordinator commits the checkpoint last
                _write_file(os.path.join(step_dir, ".metadata"), meta)
            results.put(("done", rank, (t0, time.monotonic())))
    except BaseException as e:  # noqa: BLE001 (report anything, release the other ranks)
        start.abort()
        shards_done.abort()
        results.put(("error", rank, f"{type(e).__name__}: {e}"))


class Ranks:
    """`ranks` spawned writer processes, started once and reused for both storms."""

    def __init__(self, ranks: int, nfiles: int, size: int):
        ctx = mp.get_context("spawn")
        self.ranks, self.nfiles, self.size = ranks, nfiles, size
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(ranks)]
        # kept on self: a barrier the parent drops is unlinked before the children attach to it
        self.barriers = start, shards_done = ctx.Barrier(ranks), ctx.Barrier(ranks)
        self.procs = [ctx.Process(target=_rank_main, name=f"ckptfs-demo-rank{r}", daemon=True,
                                  args=(r, ranks, nfiles, size, self.jobs[r], self.results,
                                        start, shards_done))
                      for r in range(ranks)]
        # Children start with Ctrl-C ignored, so an interrupt during their imports prints no
        # tracebacks: the parent handles it and terminates them (SIGTERM stays default).
        with _ignored(signal.SIGINT):
            for p in self.procs:
                p.start()

    def _collect(self, kind: str) -> dict[int, Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + STORM_TIMEOUT
        while len(got) < self.ranks:
            try:
                what, rank, value = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"writer processes died: {', '.join(dead)}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"writers did not finish within {STORM_TIMEOUT:.0f}s") \
                        from None
                continue
            if what == "error":
                raise RuntimeError(f"rank {rank} failed: {value}")
            if what == kind:
                got[rank] = value
        return got

    def checksums(self) -> dict[str, str]:
        """name -> xxh3_128 of every file a storm writes (.metadata included)."""
        out = {}
        for rank, sums in self._collect("ready").items():
            for i in range(self.nfiles):
                out[f"__{rank}_{i}.distcp"] = sums[i]
            if rank == 0:
                out[".metadata"] = sums[self.nfiles]
        return out

    def storm(self, step_dir: str) -> tuple[float, float]:
        """Every rank writes its shards into step_dir; returns (start, end) on the monotonic
        clock, which is one clock for all processes on Linux."""
        for q in self.jobs:
            q.put(step_dir)
        spans = self._collect("done").values()
        return min(s for s, _ in spans), max(e for _, e in spans)

    def close(self, graceful: bool) -> list[str]:
        """Stop every writer; returns the names of those that would not die (blocked in a
        request to a hung daemon: they go once the daemon is killed, see `reap`)."""
        if graceful:
            for q in self.jobs:
                q.put(None)
            _join_all(self.procs, 5)
        for stop in (mp.Process.terminate, mp.Process.kill):
            alive = [p for p in self.procs if p.is_alive()]
            for p in alive:
                stop(p)
            _join_all(alive, 3)
        return [p.name for p in self.procs if p.is_alive()]

    def reap(self) -> None:
        _join_all(self.procs, 10)
        for q in [self.results, *self.jobs]:
            q.close()
            q.cancel_join_thread()


def _join_all(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


# --- the demo -----------------------------------------------------------------------------

@dataclass
class Dirs:
    root: str
    # SHARED and the baseline's directory go here instead of under root: `--shared DIR`, a
    # fresh directory the demo made on the user's own shared filesystem
    shared_root: str | None = None
    made: list[str] = field(default_factory=list)  # --workdir's new directories, deepest first
    nvme: str = field(init=False)
    shared: str = field(init=False)
    mnt: str = field(init=False)
    straight: str = field(init=False)
    export: str = field(init=False)

    def __post_init__(self) -> None:
        self.nvme = os.path.join(self.root, "nvme")
        top = self.shared_root or self.root
        self.shared = os.path.join(top, "shared")
        self.mnt = os.path.join(self.root, "mnt")
        # the baseline: a plain directory on the same filesystem as SHARED
        self.straight = os.path.join(top, "shared-plain")
        self.export = os.path.join(self.root, "export")
        for d in (self.nvme, self.shared, self.mnt, self.straight):
            os.mkdir(d)


class DemoError(Exception):
    pass


def _run(argv: list[str], what: str, **kw: Any) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, **kw)
    if res.returncode != 0:
        err = (res.stderr or "").strip() if isinstance(res.stderr, str) else ""
        raise DemoError(f"{what} failed (exit {res.returncode})" + (f": {err}" if err else ""))
    return res


def _mount(dirs: Dirs) -> None:
    """`ckptfs mount` in the background form. It runs in its own session and is waited for
    even through Ctrl-C: killed halfway, it could leave a daemon that mounts after we looked."""
    proc = subprocess.Popen(_ckptfs("mount", dirs.nvme, dirs.shared, dirs.mnt, "--node-id",
                                    "demo", "--segment-size", "64M"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    interrupted = False
    while True:
        try:
            _out, err = proc.communicate()
            break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt
    if proc.returncode != 0:
        raise DemoError(f"ckptfs mount failed (exit {proc.returncode}): {err.strip()}")


def _count_files(top: str) -> int:
    return sum(1 for _d, _s, files in os.walk(top) for f in files if not f.startswith(".tmp"))


def _hash_file(path: str) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fmt_s(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def run_demo(ranks: int = 8, files_per_rank: int = 64, size_mb: float = 1.0, keep: bool = False,
             workdir: str | None = None, shared: str | None = None) -> int:
    """Run the demo; returns the exit code (0 ok, 1 failed, 130 interrupted). `shared`: an
    existing directory (a NAS or parallel FS mount) to put SHARED and the baseline in."""
    with _termination_is_interrupt():
        return _run_demo(ranks, files_per_rank, size_mb, keep, workdir, shared)


class _Console:
    """rich's Console whose output errors are swallowed: once the terminal is gone (SIGHUP)
    a print must not stop the cleanup."""

    def __init__(self) -> None:
        from rich.console import Console

        self.rich = Console(highlight=False)

    def print(self, *a: Any, **kw: Any) -> None:
        if all(isinstance(x, str) for x in a):
            # a line of text is not broken at rich's width (80 when piped, e.g. to a CI log,
            # where "513\nfiles" would follow); a terminal wraps it
            kw.setdefault("soft_wrap", True)
        try:
            self.rich.print(*a, **kw)
        except OSError:
            pass


def _run_demo(ranks: int, files_per_rank: int, size_mb: float, keep: bool,
              workdir: str | None, shared: str | None = None) -> int:
    con = _Console()
    size = max(1, int(size_mb * (1 << 20)))
    nfiles = ranks * files_per_rank + 1
    total = ranks * files_per_rank * size
    made: list[str] = []  # directories of --workdir that did not exist: removed afterwards
    if workdir is not None:
        d = os.path.abspath(workdir)
        while not os.path.exists(d):
            made.append(d)
            d = os.path.dirname(d)
        os.makedirs(workdir, exist_ok=True)
    # realpath: the cleanup finds the mount in /proc/mounts by this exact path, never by stat
    root = os.path.realpath(tempfile.mkdtemp(prefix="ckptfs-demo-", dir=workdir))
    shared_root = None
    if shared is not None:
        try:
            shared_root = os.path.realpath(tempfile.mkdtemp(prefix="ckptfs-demo-", dir=shared))
        except OSError as e:
            shutil.rmtree(root, ignore_errors=True)
            con.print(f"[red]ckptfs demo failed:[/] cannot make a directory in --shared "
                      f"{shared}: {e.strerror}")
            return 1
    dirs = Dirs(root, shared_root)
    dirs.made = made
    writers: Ranks | None = None
    daemon_pid: int | None = None
    ok = False
    try:
        con.print(f"[bold]ckptfs demo[/] in {dirs.root}: {ranks} ranks x {files_per_rank} files "
                  f"x {size / (1 << 20):g} MiB = {nfiles} files, {total / (1 << 20):,.0f} MiB")
        if dirs.shared_root is not None:
            con.print(f"SHARED and the straight save's directory: {dirs.shared_root}")
        writers = Ranks(ranks, files_per_rank, size)
        _mount(dirs)
        daemon_pid = int(os.getxattr(dirs.mnt, "user.ckptfs.pid"))
        con.print(f"mounted ckptfs at {dirs.mnt} (daemon pid {daemon_pid})")
        expected = writers.checksums()

        # 1. the storm through ckptfs
        t0, t1 = writers.storm(os.path.join(dirs.mnt, STEP))
        con.print(f"training-visible save through ckptfs: {_fmt_s(t1 - t0)} "
                  f"({total / (1 << 20) / (t1 - t0):,.0f} MiB/s)")
        con.print("waiting until the checkpoint is durable on SHARED (ckptfs wait)...")
        _run(_ckptfs("wait", "--quiet", "--timeout", str(STORM_TIMEOUT),
                     os.path.join(dirs.mnt, STEP)), "ckptfs wait")
        t_durable = time.monotonic()
        con.print(f"durable on SHARED {_fmt_s(t_durable - t0)} after the save began")
        st = json.loads(_run(_ckptfs("status", dirs.mnt, "--json"), "ckptfs status",
                             capture_output=True, text=True).stdout)
        shared_ops: dict[str, int] = st.get("shared_ops", {})

        # 2. the same storm straight into a plain directory on SHARED's filesystem
        s0, s1 = writers.storm(os.path.join(dirs.straight, STEP))
        con.print(f"the same save straight into a plain directory: {_fmt_s(s1 - s0)}")

        # 3. every byte back out of the shared store, with no mount involved
        _run(_ckptfs("export", dirs.shared, STEP, dirs.export), "ckptfs export",
             capture_output=True, text=True)
        bad = [name for name, want in sorted(expected.items())
               if not os.path.isfile(p := os.path.join(dirs.export, name))
               or _hash_file(p) != want]
        extra = _count_files(dirs.export) - len(expected)
        if bad or extra:
            raise DemoError(f"verification failed: {len(bad)} files missing or different "
                            f"(first: {bad[:3]}), {max(extra, 0)} unexpected files")
        con.print(f"verified: all {len(expected)} files exported from SHARED match "
                  "what the ranks wrote (xxh3-128)")

        objects = _count_files(os.path.join(dirs.shared, layout.SHARED_ROOT, "objects"))
        manifests = _count_files(os.path.join(dirs.shared, layout.SHARED_ROOT, "manifests"))
        straight_files = _count_files(dirs.straight)
        _table(con, nfiles, straight_files, objects, manifests, shared_ops,
               straight=(s1 - s0), through=(t1 - t0), durable=(t_durable - t0),
               own_shared=dirs.shared_root is not None)
        ok = True
        return 0
    except KeyboardInterrupt as e:
        why = f"terminated by {e}" if isinstance(e, _Terminated) else "interrupted"
        con.print(f"[yellow]{why}: cleaning up[/]")
        return 130
    except (DemoError, RuntimeError, OSError) as e:
        con.print(f"[red]ckptfs demo failed:[/] {e}")
        _log_tail(con, dirs.nvme)
        return 1
    finally:
        # Every step below is bounded, and a second Ctrl-C (or the terminal closing) must not
        # stop it halfway; programs it starts inherit the ignoring.
        with _ignored(signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            _cleanup(con, dirs, writers, daemon_pid, ok, keep)


def _cleanup(con: Any, dirs: Dirs, writers: Ranks | None, pid: int | None, ok: bool,
             keep: bool) -> None:
    stuck = writers.close(graceful=ok) if writers is not None else []
    if pid is None:
        pid = _lock_holder(dirs.nvme)
    # Writers that cannot be stopped are blocked in a request to a hung daemon: `ckptfs
    # umount` would block the same way, so go straight to the forced path.
    if (_mounted(dirs.mnt) or (pid is not None and _alive(pid))) \
            and (stuck or not _umount(con, dirs.mnt, drain=ok)):
        _force_unmount(con, dirs.mnt, pid, why=f"writers stuck: {', '.join(stuck)}"
                       if stuck else "ckptfs umount failed")
    if writers is not None:
        writers.reap()
    if _mounted(dirs.mnt):
        con.print(f"[red]{dirs.mnt} is still mounted; left {dirs.root} in place[/]")
        if dirs.shared_root is not None:
            con.print(f"[red]left {dirs.shared_root} in place too[/]")
    elif keep:
        if dirs.shared_root is None:
            con.print(f"kept {dirs.root} (nvme/, shared/, shared-plain/, export/)")
        else:
            con.print(f"kept {dirs.root} (nvme/, export/) and {dirs.shared_root} (shared/, "
                      "shared-plain/)")
    else:
        shutil.rmtree(dirs.root, ignore_errors=True)
        if dirs.shared_root is not None:
            shutil.rmtree(dirs.shared_root, ignore_errors=True)
        for d in dirs.made:  # only if empty: something else may have been put there since
            try:
                os.rmdir(d)
            except OSError:
                break


def _table(con: Any, nfiles: int, straight_files: int, objects: int, manifests: int,
           shared_ops: dict[str, int], straight: float, through: float, durable: float,
           own_shared: bool = False) -> None:
    from rich.table import Table

    ops = sum(shared_ops.values())
    detail = ", ".join(f"{k} {v}" for k, v in sorted(shared_ops.items(), key=lambda kv: -kv[1]))
    # straight: one mkdir, then per file a create and an fsync (what ckptfs counts for itself)
    straight_ops = 1 + 2 * straight_files
    t = Table(title="step_100, before / after", title_justify="left")
    t.add_column("")
    t.add_column("straight to shared dir", justify="right")
    t.add_column("through ckptfs", justify="right")
    t.add_row("files written by training", f"{nfiles:,}", f"{nfiles:,}")
    t.add_row("files on shared storage", f"{straight_files:,}",
              f"{objects} object{'s' * (objects != 1)} + "
              f"{manifests} manifest{'s' * (manifests != 1)}")
    t.add_row("shared-store ops", f"{straight_ops:,}", f"{ops:,}")
    t.add_row("training waits for save", _fmt_s(straight), _fmt_s(through))
    t.add_row("durable on shared after", _fmt_s(straight), _fmt_s(durable))
    con.print(t)
    con.print(f"[dim]ckptfs shared-store ops: {detail or 'none'}; straight: 1 mkdir, "
              f"{straight_files:,} creates, {straight_files:,} fsyncs.[/]")
    if own_shared:
        con.print("[dim]Both saves went to the directory given with --shared: the straight one "
                  "paid its create and fsync per file there, ckptfs's paid them on local disk "
                  "and sent the store only the objects above.[/]")
        return
    con.print("[dim]Honest note: the \"shared dir\" here is a plain local directory on the "
              "same disk, so the straight save is cheap, and the ckptfs save pays for FUSE on 2 "
              "cores shared with the writers. On a real NAS every create and fsync is a round "
              "trip to its metadata server (milliseconds each, worse under a storm), so the "
              "straight save grows with the file count; through ckptfs the NAS sees only the "
              "few large sequential objects above, written while training goes on. "
              "Try it on your own store: ckptfs demo --shared /path/on/your/nas[/]")


def _log_tail(con: Any, nvme: str, lines: int = 15) -> None:
    try:
        with open(os.path.join(nvme, "ckptfs.log"), errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
    except OSError:
        return
    if tail:
        con.print("[dim]daemon log (last lines):[/]")
        for line in tail:
            con.print(f"  {line}", markup=False, style="dim")


def _mounted(mnt: str) -> bool:
    """From /proc/mounts alone: stat() on the mount would hang if the daemon is hung."""
    return any(m == mnt for _src, m, _type in layout.mounts())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _serves(pid: int, mnt: str) -> bool:
    """Is pid (still) the daemon of mnt? Guards the kill against a reused pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return _alive(pid) and b"ckptfs" in argv and os.fsencode(mnt) in argv


def _lock_holder(nvme: str) -> int | None:
    """The pid of the daemon holding NVME's lock (the first line of the file), if one does."""
    import fcntl

    try:
        fd = os.open(os.path.join(nvme, layout.LOCK_FILE), os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 64, 0).decode(errors="replace").partition("\n")[0].strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it: no daemon
        return None
    finally:
        os.close(fd)


def _umount(con: Any, mnt: str, drain: bool) -> bool:
    """`ckptfs umount` (drains first after a successful run). True if it worked."""
    argv = _ckptfs("umount", mnt, "--timeout", "120" if drain else "20")
    if not drain:
        argv.append("--no-drain")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _out, err = proc.communicate(timeout=150 if drain else 30)
    except subprocess.TimeoutExpired:
        proc.kill()  # it may be blocked on the mount; the forced path frees it
        con.print("[yellow]ckptfs umount timed out[/]")
        return False
    if proc.returncode != 0:
        con.print(f"[yellow]ckptfs umount failed: {err.strip()}[/]")
        return False
    con.print(f"unmounted {mnt}")
    return not _mounted(mnt)


def _force_unmount(con: Any, mnt: str, pid: int | None, why: str) -> None:
    """Detach the mount lazily and SIGKILL the daemon this demo started (found by the pid it
    reported, or by the NVME lock it holds: never by name)."""
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        subprocess.run(["fusermount3", "-uz", mnt], check=False, stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=30)
    if pid is not None and _serves(pid, mnt):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    con.print(f"[yellow]forced cleanup ({why}): detached {mnt}"
              + (f", killed daemon pid {pid}" if pid is not None else "") + "[/]")


# --- CLI glue (`ckptfs demo`) -------------------------------------------------------------

def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return v


def _existing_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"not an existing directory: {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ckptfs.cli import positive_int

    parser.add_argument("--ranks", type=positive_int, default=8,
                        help="writer processes, one per simulated rank (default 8)")
    parser.add_argument("--files-per-rank", type=positive_int, default=64,
                        help="shard files each rank writes (default 64)")
    parser.add_argument("--size-mb", type=_positive_float, default=1.0,
                        help="size of each shard file in MiB (default 1)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the directories afterwards (the mount is always removed)")
    parser.add_argument("--workdir", help="make the demo's directories under this directory "
                                          "(default: the system temp directory)")
    parser.add_argument("--shared", metavar="DIR", type=_existing_dir,
                        help="put SHARED, and the directory the straight save writes to, in a "
                             "new directory under DIR (your NAS or parallel FS; removed "
                             "afterwards); the log stays under --workdir")


def main(args: argparse.Namespace) -> int:
    return run_demo(ranks=args.ranks, files_per_rank=args.files_per_rank, size_mb=args.size_mb,
                    keep=args.keep, workdir=args.workdir, shared=args.shared)


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="python -m ckptfs.demo")
    add_arguments(_p)
    raise SystemExit(main(_p.parse_args()))
