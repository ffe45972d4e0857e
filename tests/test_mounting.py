"""The mount harness itself, including its failure path: a cleanup path nobody runs rots."""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from mounting import (
    FSTYPE,
    Mount,
    fuse_mounts_under,
    is_mounted,
    lazy_unmount_all_under,
    listdir_errno,
    mount_entry,
    pid_alive,
    pids_with_arg,
    proc_mounts,
    run_cli,
)

HERE = Path(__file__).parent


def test_mount_is_up_and_unmounts_cleanly(tmp_path: Path) -> None:
    m = Mount(tmp_path / "m")
    try:
        m.start()
        row = mount_entry(m.mnt)
        assert row is not None and row[2] == FSTYPE, row
        assert row[0] == "ckptfs", f"fsname should be ckptfs, /proc/mounts says {row}"
        assert os.stat(m.mnt).st_dev != os.stat(m.root).st_dev
        (m.mnt / "hello").write_bytes(b"world")
        m.unmount()  # asserts exit status 0 and that the mount is gone
        assert not (m.mnt / "hello").exists()
        m.start()
        assert (m.mnt / "hello").read_bytes() == b"world"
        m.unmount()
    finally:
        problems = m.teardown()
    assert problems == []
    assert fuse_mounts_under(tmp_path) == []


def test_teardown_cleans_stale_mount_after_sigkill(tmp_path: Path) -> None:
    m = Mount(tmp_path / "m")
    try:
        m.start()
        pid = m.proc.pid  # type: ignore[union-attr]
        m.kill()
        assert is_mounted(m.mnt), "a SIGKILLed daemon should leave its mount behind"
        assert listdir_errno(m.mnt) == errno.ENOTCONN
    finally:
        problems = m.teardown()
    assert problems == []  # killed on purpose: a stale mount is expected, not a problem
    assert not is_mounted(m.mnt, None)
    assert fuse_mounts_under(tmp_path) == []
    assert not pid_alive(pid)


def test_teardown_reports_a_daemon_that_died_by_itself(tmp_path: Path) -> None:
    m = Mount(tmp_path / "m")
    m.start()
    os.kill(m.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]  # behind the helper's back
    m.proc.wait(30)  # type: ignore[union-attr]
    problems = m.teardown()
    assert any("died" in p for p in problems), problems
    assert fuse_mounts_under(tmp_path) == []


def test_teardown_of_busy_mount_falls_back_to_lazy_unmount_and_kill(tmp_path: Path) -> None:
    m = Mount(tmp_path / "m")
    m.start()
    pid = m.proc.pid  # type: ignore[union-attr]
    fd = os.open(m.mnt / "held-open", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        problems = m.teardown()
    finally:
        try:
            os.close(fd)
        except OSError:
            pass  # the daemon behind this fd is gone
    assert any("fusermount3 -u failed" in p for p in problems), problems
    assert not is_mounted(m.mnt, None)
    assert not pid_alive(pid)
    assert fuse_mounts_under(tmp_path) == []


def test_lazy_unmount_all_under_releases_dead_mounts(tmp_path: Path) -> None:
    # What the session finalizer relies on.
    a, b = Mount(tmp_path / "a"), Mount(tmp_path / "b")
    try:
        a.start()
        b.start()
        a.kill()
        b.kill()
        assert sorted(fuse_mounts_under(tmp_path)) == sorted([str(a.mnt), str(b.mnt)])
        assert sorted(lazy_unmount_all_under(tmp_path)) == sorted([str(a.mnt), str(b.mnt)])
        assert fuse_mounts_under(tmp_path) == []
    finally:
        a.teardown()
        b.teardown()


@pytest.mark.timeout(180)
def test_fixture_teardown_in_a_failing_pytest_run(tmp_path: Path) -> None:
    """Run the real fixtures in an inner pytest whose tests fail or misbehave on purpose, and
    check the outer view: the right outcomes, no mount and no daemon left behind."""
    inner = tmp_path / "inner"
    inner.mkdir()
    shutil.copy(HERE / "conftest.py", inner / "conftest.py")
    shutil.copy(HERE / "mounting.py", inner / "mounting.py")
    (inner / "test_inner.py").write_text(
        textwrap.dedent(
            """
            import errno, os

            def test_killed_then_fails(mount):
                (mount.mnt / "f").write_bytes(b"x")
                mount.kill()
                try:
                    os.listdir(mount.mnt)
                except OSError as exc:
                    assert exc.errno == errno.ENOTCONN
                assert False, "deliberate failure after SIGKILL"

            def test_daemon_crashes_under_a_passing_test(mount):
                os.kill(mount.proc.pid, 9)  # not via mount.kill(): looks like a crash
                mount.proc.wait()

            def test_passes_but_leaves_fd_open(mount):
                global LEAK
                LEAK = os.open(mount.mnt / "g", os.O_CREAT | os.O_RDWR, 0o644)

            def test_fails_with_fd_open(mount):
                fd = os.open(mount.mnt / "h", os.O_CREAT | os.O_RDWR, 0o644)
                assert False, "deliberate failure with a busy mount"

            def test_clean(mount):
                (mount.mnt / "ok").write_bytes(b"ok")
            """
        )
    )
    (inner / "pytest.ini").write_text("[pytest]\n")
    # A short basetemp: the daemon's own paths must stay short of AF_UNIX's 108 bytes, and
    # long paths are test_cli_errors.py's business, not this test's.
    basetemp = Path(tempfile.mkdtemp(prefix="ckbt-", dir="/tmp"))
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q",
         f"--basetemp={basetemp}", str(inner)],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=inner,
        check=False,
    )
    out = res.stdout + res.stderr
    try:
        # Two deliberate failures; three passing tests, two of whose teardown needed the
        # failure path and so error.
        assert "2 failed, 3 passed, 2 errors" in out, out
        assert "daemon that died" in out, out
        assert "fusermount3 -u failed" in out, out
        assert res.returncode == 1, out
    finally:
        leaked = fuse_mounts_under(basetemp)
        lazy_unmount_all_under(basetemp)
        survivors = [p for p in pids_with_arg(str(basetemp)) if pid_alive(p)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        if not leaked:
            shutil.rmtree(basetemp, ignore_errors=True)
    assert leaked == [], f"inner run leaked mounts: {leaked}"
    assert survivors == [], f"inner run leaked daemons: {survivors}"


ARENAS_PROBE = textwrap.dedent("""
    import threading
    from ckptfs.daemon import limit_malloc_arenas
    capped = limit_malloc_arenas()
    start = threading.Barrier(8)
    def work():
        start.wait()
        for _ in range(500):
            blocks = [bytearray(300_000) for _ in range(4)]
            del blocks
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # each arena besides the main one is a 64 MiB-aligned heap: a rw-p mapping at its
    # start followed by the ---p rest of its 64 MiB reservation
    spans = []
    for line in open("/proc/self/maps"):
        addr, perm = line.split()[:2]
        lo, hi = (int(x, 16) for x in addr.split("-"))
        spans.append((lo, hi, perm))
    heaps = sum(1 for (a, b, p), (c, d, q) in zip(spans, spans[1:])
                if p == "rw-p" and q == "---p" and b == c and a % (64 << 20) == 0
                and d - a == 64 << 20)
    print(capped, heaps)
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc arenas")
def test_the_daemon_caps_malloc_arenas_unless_told_otherwise() -> None:
    """Worker threads each get a glibc arena of their own by default, which keeps what they
    freed: the daemon caps them at 2 (CKPTFS_MALLOC_ARENAS); MALLOC_ARENA_MAX in the
    environment, or CKPTFS_MALLOC_ARENAS=0, leaves glibc to decide."""
    def probe(**env: str) -> tuple[str, int]:
        e = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        res = subprocess.run([sys.executable, "-c", ARENAS_PROBE], env={**e, **env},
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        capped, heaps = res.stdout.split()
        return capped, int(heaps)

    assert probe() == ("True", 1)  # the main arena and one more
    capped, heaps = probe(CKPTFS_MALLOC_ARENAS="0")
    assert capped == "False" and heaps >= 4, heaps
    assert probe(MALLOC_ARENA_MAX="3") == ("False", 2)


SCHED_PROBE = textwrap.dedent("""
    import json, os, threading
    from ckptfs import sched
    def me():
        tid = threading.get_native_id()
        return os.getpriority(os.PRIO_PROCESS, tid), sched.status()["slice_us"]
    out = {"start": me(), "raised": sched.raise_priority(), "after": me()}
    def worker():
        out["thread"] = me()  # threads started after inherit the raised priority
        with sched.background():
            out["background"] = me()
            with sched.background():
                out["nested"] = me()
            out["background_after_nested"] = me()
        out["thread_after"] = me()
        out["decorated"] = sched.in_background(me)()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    print(json.dumps(out))
""")


def _sched_probe(*prefix: str, **env: str) -> dict:
    res = subprocess.run([*prefix, sys.executable, "-c", SCHED_PROBE],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return {k: (tuple(v) if isinstance(v, list) else v)
            for k, v in json.loads(res.stdout).items()}


def _default_slice_us() -> int | None:
    # what a fresh thread of this kernel gets (None: the kernel does not show slices)
    return _sched_probe(CKPTFS_PRIORITY="0")["start"][1]


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs CAP_SYS_NICE")
def test_the_daemon_raises_its_threads_and_runs_background_work_as_it_was_started() -> None:
    """Ranks wait on the daemon for every request: it raises its threads 10 nice levels
    (CKPTFS_PRIORITY; CKPTFS_SLICE_US asks for a slice of their own as well), and background
    work goes back to the priority it was started with while it runs."""
    default = _default_slice_us()
    for env, slice_us in (({}, default), ({"CKPTFS_SLICE_US": "100"}, 100)):
        out = _sched_probe(**env)
        base, _ = out["start"]
        want = max(base - 10, -20)
        assert out["raised"] is True
        assert out["after"] == out["thread"] == out["thread_after"] == (
            want, None if default is None else slice_us), (env, out)
        for k in ("background", "nested", "background_after_nested", "decorated"):
            assert out[k] == (base, default), (k, env, out)

    off = _sched_probe(CKPTFS_PRIORITY="0")
    assert off["raised"] is False
    assert off["after"] == off["thread"] == off["background"] == off["start"], off

    # raised relative to where it started, and back to it
    res = _sched_probe(CKPTFS_PRIORITY="3")
    assert res["after"][0] == res["start"][0] - 3 and res["background"][0] == res["start"][0]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="root and util-linux's setpriv, to take CAP_SYS_NICE away")
def test_without_cap_sys_nice_the_daemon_runs_as_started_and_background_is_a_no_op() -> None:
    out = _sched_probe("setpriv", "--bounding-set", "-sys_nice")
    assert out["raised"] is False
    assert out["after"] == out["thread"] == out["background"] == out["start"], out


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs CAP_SYS_NICE")
def test_a_mounted_daemon_serves_requests_at_the_raised_priority(tmp_path: Path) -> None:
    """What `ckptfs status` says is what the kernel has for the request thread."""
    for env, raised in (({}, True), ({"CKPTFS_PRIORITY": "0"}, False)):
        m = Mount(tmp_path / f"m{int(raised)}", env={**os.environ, **env})
        try:
            m.start()
            (m.mnt / "f").write_bytes(b"x" * 1000)  # the request path works
            res = run_cli("status", m.mnt, "--json")
            assert res.rc == 0, res
            pr = json.loads(res.out)["priority"]
            pid = m.proc.pid  # type: ignore[union-attr]
            nice = int(Path(f"/proc/{pid}/task/{pid}/stat").read_text()
                       .rsplit(")", 1)[1].split()[16])
            assert pr["raised"] is raised and pr["nice"] == nice, (pr, nice)
            assert nice == (max(pr["started_nice"] - 10, -20) if raised
                            else pr["started_nice"]), pr
            m.unmount()
        finally:
            assert m.teardown() == []


@pytest.mark.parametrize("args,kernel", [((), False), (("--default-permissions",), True),
                                         (("--allow-other",), True)])
def test_a_mount_only_root_can_use_leaves_permission_checks_out_and_behaves_the_same(
        make_mount, args: tuple[str, ...], kernel: bool) -> None:
    """A mount by root without --allow-other: only root can use it, and the kernel's checks
    (default_permissions, a GETATTR of the directory in each create) are left out; root may
    still not run a file that no one may execute, and access() says so as the kernel would.
    --default-permissions and --allow-other keep the kernel's checks."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    m = make_mount(extra_args=args)
    [opts] = [o for _s, mp, _t, o in proc_mounts() if mp == str(m.mnt)]
    assert ("default_permissions" in opts.split(",")) == kernel, opts
    plain, script, ro = m.mnt / "plain", m.mnt / "script.sh", m.mnt / "ro"
    plain.write_text("#!/bin/sh\nexit 0\n")
    script.write_text("#!/bin/sh\nexit 7\n")
    script.chmod(0o700)
    ro.write_text("x")
    ro.chmod(0o444)
    locked = m.mnt / "locked"
    locked.mkdir(mode=0o000)
    assert not os.access(plain, os.X_OK) and os.access(plain, os.R_OK | os.W_OK)
    assert os.access(script, os.X_OK) and os.access(locked, os.R_OK | os.W_OK | os.X_OK)
    with pytest.raises(PermissionError):
        subprocess.run([str(plain)], check=False)
    assert subprocess.run([str(script)], check=False).returncode == 7
    ro.write_text("root writes a read-only file, as on ext4")
    (locked / "f").write_text("and into a directory with mode 000")
    assert sorted(os.listdir(locked)) == ["f"]
    m.unmount()
