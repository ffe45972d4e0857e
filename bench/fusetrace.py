"""Where a storm's creates wait, as the kernel times them:

    python -m bench.fusetrace [--files 3000] [--ranks 8] [--min-kib 256] [--max-kib 1024]

A storm (rank processes creating shards in one directory, a fsync each, as `python -m bench`'s)
through a ckptfs mount over a local SHARED directory, with the kernel's FUSE tracepoints
(`fuse_request_send` when a request is queued, `fuse_request_end` when its reply arrives), the
ranks' `openat` and the daemon's `read(2)`s of `/dev/fuse` recorded by ftrace. Each request's
time splits into its wait in the kernel's queue (until the daemon read it: the queue is FIFO)
and the daemon's time on it; each `open(O_CREAT)` into its wait for the directory's lock and the
LOOKUP and CREATE the kernel sends under it, one file after the other (bench/README.md,
2026-12-07, afternoon). Needs root and tracefs (mounted at /sys/kernel/tracing if it is not);
tracing slows the storm by a third or so, so its times are for comparing parts, not runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench import mounts
from bench import workloads as wl

TRACING = Path("/sys/kernel/tracing")
OPS = {1: "LOOKUP", 16: "WRITE", 18: "RELEASE", 20: "FSYNC", 25: "FLUSH", 35: "CREATE"}
SYSCALLS = ("sys_enter_read", "sys_exit_read")
LINE = re.compile(r"^\s*.+?-(\d+)\s+\[\d+\]\s+\S+\s+([\d.]+):\s+(.*)$")


def _write(path: Path, value: str) -> None:
    path.write_text(value + "\n")


@contextlib.contextmanager
def tracefs() -> Iterator[None]:
    """tracefs at /sys/kernel/tracing for the while (unmounted again if this mounted it)."""
    mounted = False
    if not (TRACING / "events").is_dir():
        mounted = subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACING)],
                                 capture_output=True).returncode == 0
    try:
        if not (TRACING / "events" / "fuse" / "fuse_request_send").exists():
            raise SystemExit("fusetrace: no FUSE tracepoints in /sys/kernel/tracing (needs "
                             "root, tracefs and a kernel with events/fuse)")
        yield
    finally:
        if mounted:
            subprocess.run(["umount", str(TRACING)], capture_output=True)


@contextlib.contextmanager
def tracing(connection: int, daemon: int) -> Iterator[Path]:
    """ftrace on for the events read here; off, filters and buffer as they were, afterwards."""
    size = (TRACING / "buffer_size_kb").read_text().split()[0]
    filters = {f"fuse/{e}": f"connection == {connection}"
               for e in ("fuse_request_send", "fuse_request_end")}
    filters |= {f"syscalls/{e}": f"common_pid == {daemon}" for e in SYSCALLS}
    try:
        _write(TRACING / "tracing_on", "0")
        _write(TRACING / "trace", "")
        _write(TRACING / "buffer_size_kb", "262144")
        for event, flt in filters.items():
            _write(TRACING / "events" / event / "filter", flt)
            _write(TRACING / "events" / event / "enable", "1")
        for e in ("sys_enter_openat", "sys_exit_openat"):
            _write(TRACING / "events" / "syscalls" / e / "enable", "1")
        _write(TRACING / "tracing_on", "1")
        yield TRACING / "trace"
    finally:
        _write(TRACING / "tracing_on", "0")
        for event in [*filters, "syscalls/sys_enter_openat", "syscalls/sys_exit_openat"]:
            _write(TRACING / "events" / event / "enable", "0")
            if event in filters:
                _write(TRACING / "events" / event / "filter", "0")
        _write(TRACING / "trace", "")
        _write(TRACING / "buffer_size_kb", size)


def _rank(directory: str, files: list[wl.FileSpec], seed: int, start: int) -> None:
    buf = wl.make_buffer(seed)
    while time.monotonic() < start:
        time.sleep(0.001)
    for spec in files:
        wl._write_file(os.path.join(directory, spec.name), spec, buf, wl.MiB, True)


def storm(directory: str, plan: list[list[wl.FileSpec]]) -> float:
    """Every rank a forked process, started together; seconds until the last one is done."""
    start = time.monotonic() + 1.0 + 0.1 * len(plan)  # (each rank makes its buffer first)
    pids = []
    for r, files in enumerate(plan):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _rank(directory, files, 100 + r, start)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    bad = sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in pids)
    if bad:
        raise SystemExit(f"fusetrace: {bad} rank(s) failed")
    return time.monotonic() - start


def parse(lines: Iterator[str]) -> dict:
    """Requests (send, read by the daemon, reply) and the ranks' opens with O_CREAT."""
    sends, ends, reads, opens = [], {}, [], collections.defaultdict(list)
    entered: dict[int, float] = {}
    reading: dict[int, int] = {}  # pid: the fd it reads
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        pid, ts, rest = int(m.group(1)), float(m.group(2)), m.group(3)
        if rest.startswith("fuse_request_send"):
            u, op, n = re.search(r"req (\d+) opcode (\d+) \(\w+\) len (\d+)", rest).groups()
            sends.append((ts, int(u), int(op), int(n), pid))
        elif rest.startswith("fuse_request_end"):
            ends[int(re.search(r"req (\d+)", rest).group(1))] = ts
        elif rest.startswith("sys_openat("):
            flags = re.search(r"flags: (0x[0-9a-f]+)", rest)
            if flags and int(flags.group(1), 16) & os.O_CREAT:
                entered[pid] = ts
        elif rest.startswith("sys_openat ->") and pid in entered:
            opens[pid].append((entered.pop(pid), ts))
        elif rest.startswith("sys_read("):
            fd = re.search(r"fd: (0x[0-9a-f]+)", rest)
            if fd:
                reading[pid] = int(fd.group(1), 16)
        elif rest.startswith("sys_read ->") and pid in reading:
            fd = reading.pop(pid)
            n = int(rest.split("->")[1], 16)
            if 0 < n < 1 << 40:
                reads.append((ts, n, fd))
    # /dev/fuse: the daemon's descriptor read most
    fuse_fd = collections.Counter(fd for _ts, _n, fd in reads).most_common(1)
    reads = [(ts, n) for ts, n, fd in reads if fuse_fd and fd == fuse_fd[0][0]]
    # The kernel hands requests out in the order they were queued (FORGETs aside, which are
    # not traced: a read whose length matches no queued request is one of those).
    read_at: dict[int, float] = {}
    pending: collections.deque = collections.deque()
    k = 0
    sends.sort()
    for ts, n in reads:
        while k < len(sends) and sends[k][0] <= ts:
            pending.append(sends[k])
            k += 1
        for i, s in enumerate(pending):
            if s[3] == n:
                read_at[s[1]] = ts
                del pending[i]
                break
    return {"sends": sends, "ends": ends, "read_at": read_at, "opens": opens}


def _stat(v: list[float]) -> str:
    v = sorted(v)
    return (f"{statistics.mean(v) * 1e3:7.3f} {v[len(v) // 2] * 1e3:7.3f} "
            f"{v[int(len(v) * 0.9)] * 1e3:7.3f}")


def report(t: dict) -> dict[str, list[float]]:
    sends, ends, read_at = t["sends"], t["ends"], t["read_at"]
    print(f"{'request':10s} {'n':>6s}   queued ms: mean     p50     p90 |"
          "  daemon ms: mean     p50     p90")
    by_op = collections.defaultdict(list)
    for ts, u, op, _n, _pid in sends:
        if u in read_at and u in ends:
            by_op[op].append((read_at[u] - ts, ends[u] - read_at[u]))
    for op, v in sorted(by_op.items(), key=lambda kv: -len(kv[1])):
        if op in OPS:
            print(f"{OPS[op]:10s} {len(v):6d}            {_stat([q for q, _ in v])} |"
                  f"             {_stat([d for _, d in v])}")
    by_pid = collections.defaultdict(list)
    for s in sends:
        by_pid[s[4]].append(s)
    parts: dict[str, list[float]] = collections.defaultdict(list)
    holds = []
    for pid, episodes in t["opens"].items():
        for a, b in episodes:
            reqs = [s for s in by_pid[pid] if a <= s[0] <= b]
            if [s[2] for s in reqs] != [1, 35]:
                continue
            (l0, lu, *_), (c0, cu, *_) = reqs
            if not {lu, cu} <= read_at.keys() or not {lu, cu} <= ends.keys():
                continue
            parts["open(O_CREAT), all of it"].append(b - a)
            parts["  waits for the directory's lock"].append(l0 - a)
            parts["  LOOKUP queued"].append(read_at[lu] - l0)
            parts["  LOOKUP in the daemon"].append(ends[lu] - read_at[lu])
            parts["  LOOKUP's reply to CREATE sent"].append(c0 - ends[lu])
            parts["  CREATE queued"].append(read_at[cu] - c0)
            parts["  CREATE in the daemon"].append(ends[cu] - read_at[cu])
            parts["  CREATE's reply to open() returns"].append(b - ends[cu])
            holds.append((l0, ends[cu]))
    if not holds:
        print("no open(O_CREAT) with a LOOKUP and a CREATE found in the trace")
        return parts
    holds.sort()
    parts["lock passed on (a CREATE's reply to the next LOOKUP)"] = [
        n[0] - p[1] for p, n in zip(holds, holds[1:]) if n[0] > p[1]]
    print(f"\n{'per file':52s} {'n':>6s}    mean     p50     p90 (ms)")
    for k, v in parts.items():
        print(f"{k:52s} {len(v):6d} {_stat(v)}")
    span = holds[-1][1] - holds[0][0]
    busy = sum(b - a for a, b in holds)
    print(f"\nthe directory's chain: {len(holds)} creates in {span:.2f} s, a LOOKUP or CREATE "
          f"of it in flight {busy / span:.0%} of that time")
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fusetrace", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=3000, help="shards in the storm (3000)")
    p.add_argument("--ranks", type=int, default=8, help="rank processes (8)")
    p.add_argument("--min-kib", type=int, default=256, help="smallest shard, KiB (256)")
    p.add_argument("--max-kib", type=int, default=1024, help="largest shard, KiB (1024)")
    p.add_argument("--workdir", type=Path, help="NVME, SHARED and the mount go here "
                   "(a temporary directory)")
    a = p.parse_args(argv)
    if a.files < 1 or a.ranks < 1 or not 4 <= a.min_kib <= a.max_kib:
        p.error("need --files >= 1, --ranks >= 1 and 4 <= --min-kib <= --max-kib")
    if os.geteuid() != 0:
        p.error("ftrace needs root")
    with tracefs():
        return _run(a)


def _run(a: argparse.Namespace) -> int:
    temporary = a.workdir is None
    a.workdir = a.workdir or Path(tempfile.mkdtemp(prefix="fusetrace."))
    base = a.workdir / f"fusetrace.{os.getpid()}"
    nvme, shared, mnt = base / "nvme", base / "shared", base / "mnt"
    for d in (nvme, shared, mnt):
        d.mkdir(parents=True)
    log = open(base / "daemon.log", "w")
    daemon = subprocess.Popen([sys.executable, "-m", "ckptfs", "mount", "--foreground",
                               str(nvme), str(shared), str(mnt)], stdout=log, stderr=log)
    try:
        mounts.wait_for_mount(mnt, "fuse.ckptfs", daemon, 60, base / "daemon.log")
        directory = mnt / "ckpt"
        directory.mkdir()
        dev = os.stat(mnt).st_dev
        plan = wl.storm_plan(a.ranks, a.files, a.min_kib << 10, a.max_kib << 10)
        with tracing((os.major(dev) << 20) | os.minor(dev), daemon.pid) as trace:
            took = storm(str(directory), plan)
            _write(TRACING / "tracing_on", "0")
            with open(trace) as f:
                t = parse(f)
        print(f"storm: {a.files} files from {a.ranks} ranks in {took:.2f} s (traced)\n")
        report(t)
    finally:
        mounts.unmount(mnt, daemon, command=[sys.executable, "-m", "ckptfs", "umount",
                                             str(mnt), "--no-drain"])
        log.close()
        shutil.rmtree(a.workdir if temporary else base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
