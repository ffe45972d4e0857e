"""Measure a storage target: create rate, fsync latency, sequential bandwidth.

Bounded in time and space, leaves nothing behind: everything happens in a temporary
directory under DIR that is removed at the end, even on failure or Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass


@dataclass
class ProbeResult:
    directory: str
    creates_per_s: float
    fsync_latency_ms_p50: float
    fsync_latency_ms_p99: float
    write_bandwidth: float
    read_bandwidth: float
    bytes_used: int


def probe(directory: str, seconds: float = 2.0, max_bytes: int = 256 << 20) -> ProbeResult:
    if not os.path.isdir(directory):
        raise FileNotFoundError(directory)
    work = tempfile.mkdtemp(prefix=".ckptfs-probe-", dir=directory)
    try:
        # creates: open(O_CREAT)+close of empty files, for at most `seconds`
        n = 0
        t0 = time.monotonic()
        while n < 20000 and time.monotonic() - t0 < seconds:
            os.close(os.open(os.path.join(work, f"c{n}"), os.O_CREAT | os.O_WRONLY, 0o644))
            n += 1
        creates = n / (time.monotonic() - t0)
        # fsync latency: 4 KiB write + fsync
        lat = []
        fd = os.open(os.path.join(work, "fsync"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            block = os.urandom(4096)
            t0 = time.monotonic()
            while len(lat) < 200 and time.monotonic() - t0 < seconds:
                os.write(fd, block)
                s = time.monotonic()
                os.fsync(fd)
                lat.append((time.monotonic() - s) * 1000)
        finally:
            os.close(fd)
        # sequential write + fsync, then read back (page cache dropped for this file)
        chunk = os.urandom(8 << 20)
        path = os.path.join(work, "seq")
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
        written = 0
        try:
            t0 = time.monotonic()
            while written < max_bytes and time.monotonic() - t0 < seconds * 2:
                written += os.write(fd, chunk)
            os.fsync(fd)
            wbw = written / (time.monotonic() - t0)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        try:
            got = 0
            t0 = time.monotonic()
            while True:
                b = os.read(fd, 8 << 20)
                if not b:
                    break
                got += len(b)
            rbw = got / (time.monotonic() - t0)
        finally:
            os.close(fd)
        lat.sort()
        return ProbeResult(directory, round(creates, 1), round(statistics.median(lat), 3),
                           round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
                           round(wbw), round(rbw), written)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def as_dict(r: ProbeResult) -> dict:
    return asdict(r)
