"""Prometheus metrics on --metrics-port, and the daemon's log file."""

from __future__ import annotations

import os
import socket
import urllib.request

from mounting import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_and_log_file(make_mount, tmp_path) -> None:
    port = free_port()
    log = tmp_path / "daemon.log"
    m = make_mount(extra_args=["--node-id", "n0", "--metrics-port", str(port),
                               "--log-file", str(log)])
    for i in range(5):
        fd = os.open(m.mnt / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, b"x" * 100_000)
        os.fsync(fd)
        os.close(fd)

    def scrape() -> str | None:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        text = body.decode()
        ok = "ckptfs_fsync_seconds_count 5.0" in text and "ckptfs_bytes_written 500000.0" in text
        return text if ok else None

    text = wait_for(scrape, 20, "metrics to show the fsyncs")
    for name in ("ckptfs_bytes_pending_upload",
                 'ckptfs_segments{state="active"}', "ckptfs_local_bytes_free",
                 "ckptfs_drain_error 0.0", "ckptfs_drain_failing_seconds 0.0",
                 "ckptfs_shared_stalled_seconds 0.0"):
        assert name in text, name
    m.unmount()
    assert "mounted" in log.read_text() and "unmounted" in log.read_text()


def test_fsync_through_the_mount_flushes_the_log(make_mount) -> None:
    """fsync(fd) must reach a device flush of the log (power-loss durability needs it; a
    write without fsync must not pay for one)."""
    import json

    from mounting import run_cli

    # a long commit interval is not configurable; the daemon's index commit may flush too,
    # so check the state fsync promises: nothing of the log is left unflushed when it returns
    m = make_mount(extra_args=["--node-id", "n0"])

    def st() -> dict:
        return json.loads(run_cli("status", m.mnt, "--json").out)

    fd = os.open(m.mnt / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for _ in range(3):
            os.write(fd, b"x" * 4096)
            before = st()
            os.fsync(fd)
            after = st()
            assert after["fsync_calls"] == before["fsync_calls"] + 1
            assert after["log_unsynced_bytes"] == 0, after
            assert after["device_flushes"] >= before["device_flushes"] + (
                1 if before["log_unsynced_bytes"] else 0)
    finally:
        os.close(fd)
