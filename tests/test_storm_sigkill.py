"""A storm through a real mount, the daemon SIGKILLed in the middle of it.

Big data records go through the page cache (the default), or, as while the disk is behind,
to the log's writer thread with creates going into the log ahead of data writes queued before
them (SegmentLog.ahead), while other processes write and fsync: after a SIGKILL and a new
mount, every file whose create returned to its process exists, and every file whose fsync
returned has exactly its bytes. (The kill rarely lands in the instant a create is ahead of
writes not yet on disk: tests/test_log_pipeline.py kills a process in exactly that state.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mounting import run_cli, wait_for

WRITER = r"""
import os, random, sys
d, rank, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out = open(progress, "a", buffering=1)
buf = random.Random(rank).randbytes(3 << 20)
i = 0
try:
    while True:
        name = f"__{rank}_{i}.distcp"
        fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        out.write(f"created {name}\n")
        n = (1 + (i % 3)) << 20
        off = 0
        while off < n:
            # (every other file in writes that do not end on a page)
            off += os.write(fd, buf[off:min(n, off + (1 << 20) - 512 * (i % 2))])
        os.fsync(fd)
        out.write(f"synced {name} {n}\n")
        os.close(fd)
        i += 1
except OSError:
    pass  # the daemon is gone
"""


def status(mnt: Path) -> dict:
    return json.loads(run_cli("status", mnt, "--json").out)


@pytest.mark.parametrize("buffered", ["1", "0"])
def test_a_storm_survives_a_sigkill_with_creates_ahead_of_queued_writes(
        make_mount, buffered: str) -> None:
    m = make_mount(start=False)
    m.env = {**os.environ, "CKPTFS_BUFFERED_WRITES": buffered}
    m.start()
    d = m.mnt / "step_1"
    d.mkdir()
    procs, logs = [], []
    try:
        for rank in range(6):
            p = m.root / f"progress-{rank}"
            logs.append(p)
            procs.append(subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(rank),
                                           str(p)], stderr=subprocess.DEVNULL))
        if buffered == "1":
            wait_for(lambda: status(m.mnt)["log_records_buffered"] >= 30, 120,
                     "big records through the page cache", interval=0.05)
        else:
            # until several creates went ahead of queued writes (what this test is about)
            wait_for(lambda: status(m.mnt)["log_records_ahead"] >= 5, 120,
                     "creates to go into the log ahead of queued writes", interval=0.05)
        time.sleep(random.Random().uniform(0.0, 0.3))
        m.kill()
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    m.clean_stale()
    created, synced = set(), {}
    for p in logs:
        for line in p.read_text().splitlines():
            parts = line.split()
            if parts[0] == "created":
                created.add(parts[1])
            elif len(parts) == 3:
                synced[parts[1]] = int(parts[2])
    assert len(synced) >= 10, "too few files written to prove anything"
    m.start()
    names = set(os.listdir(d))
    assert created <= names, f"creates that returned are gone: {sorted(created - names)[:5]}"
    bufs = [random.Random(rank).randbytes(3 << 20) for rank in range(6)]
    for name, n in synced.items():
        rank = int(name.split("_")[2])
        assert (d / name).read_bytes() == bufs[rank][:n], name
    m.unmount()
