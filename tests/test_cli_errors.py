"""CLI error cases: each user mistake gets one `ckptfs: error: ...` line on stderr and a non-zero
exit, never a traceback; argparse usage errors exit 2. Also the daemonizing `ckptfs mount` /
`ckptfs umount` pair, whose contract is about when they return."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mounting import (
    FSTYPE,
    MakeMount,
    Mount,
    Result,
    ckptfs_cmd,
    fuse_mounts_under,
    fusermount,
    is_mounted,
    lazy_unmount_all_under,
    listdir_errno,
    mount_entry,
    pid_alive,
    pids_with_arg,
    run_cli,
    wait_for,
)


def assert_error_line(res: Result, *words: str) -> str:
    """Non-zero exit, exactly one stderr line `ckptfs: error: ...`, no traceback anywhere."""
    assert "Traceback" not in res.out + res.err, str(res)
    assert res.rc not in (0, 2), f"expected a runtime error exit (1), got: {res}"
    lines = res.err.strip().splitlines()
    assert len(lines) == 1, f"expected one error line: {res}"
    line = lines[0]
    assert line.startswith("ckptfs: error: "), str(res)
    low = line.lower()
    for alternatives in words:
        assert any(w in low for w in alternatives.split("|")), (
            f"error line should mention {alternatives!r}: {line}")
    return line


@pytest.fixture
def cli_cleanup(tmp_path: Path) -> Iterator[Path]:
    """For tests that daemonize: afterwards unmount whatever is under tmp_path and kill any
    process whose command line names tmp_path (daemons this test started). Fails the test if
    something had been left behind."""
    yield tmp_path
    leftovers = []
    for mnt in sorted(fuse_mounts_under(tmp_path), key=len, reverse=True):
        leftovers.append(f"mount {mnt}")
        fusermount(mnt, "-u")
    pids = [p for p in pids_with_arg(str(tmp_path)) if pid_alive(p)]
    for pid in pids:
        leftovers.append(f"process {pid}")
        os.kill(pid, signal.SIGKILL)
    lazy_unmount_all_under(tmp_path)
    assert not leftovers, f"left behind: {leftovers}"


def dirs(root: Path, *names: str) -> list[Path]:
    out = []
    for n in names:
        (root / n).mkdir(parents=True, exist_ok=True)
        out.append(root / n)
    return out


def no_daemon_for(path: Path) -> bool:
    return not [p for p in pids_with_arg(str(path)) if pid_alive(p)]


# -- mount -------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["nvme", "shared", "mnt"])
@pytest.mark.parametrize("foreground", [False, True], ids=["daemon", "foreground"])
def test_mount_with_a_missing_directory(cli_cleanup: Path, missing: str, foreground: bool
                                        ) -> None:
    root = cli_cleanup
    paths = {n: root / n for n in ("nvme", "shared", "mnt")}
    dirs(root, *(n for n in paths if n != missing))
    res = run_cli("mount", paths["nvme"], paths["shared"], paths["mnt"],
                  *(["--foreground"] if foreground else []), timeout=60)
    line = assert_error_line(res)
    assert str(paths[missing]) in line or missing in line.lower(), (
        f"the error should name the missing {missing} directory: {line}")
    assert fuse_mounts_under(root) == []
    wait_for(lambda: no_daemon_for(root), 10, "no daemon to be left")


@pytest.mark.parametrize("which", ["nvme", "mnt"])
def test_mount_with_a_file_where_a_directory_belongs(cli_cleanup: Path, which: str) -> None:
    """Said as it is: it used to say that the directory does not exist."""
    root = cli_cleanup
    paths = {n: root / n for n in ("nvme", "shared", "mnt")}
    dirs(root, *(n for n in paths if n != which))
    paths[which].write_text("a file")
    line = assert_error_line(run_cli("mount", *paths.values(), timeout=60), "not a directory")
    assert str(paths[which]) in line, line
    assert fuse_mounts_under(root) == []


def test_a_mount_over_a_non_empty_directory_says_what_it_hides(cli_cleanup: Path) -> None:
    nvme, shared, mnt = dirs(cli_cleanup, "nvme", "shared", "mnt")
    (mnt / "old_checkpoint").write_text("before")
    res = run_cli("mount", nvme, shared, mnt, timeout=60)
    assert res.rc == 0, str(res)
    try:
        assert "warning" in res.err and "not empty" in res.err and "1 entries" in res.err, \
            str(res)
        assert os.listdir(mnt) == []
    finally:
        assert run_cli("umount", mnt, timeout=120).rc == 0
    assert (mnt / "old_checkpoint").read_text() == "before"


@pytest.mark.parametrize("foreground", [False, True], ids=["daemon", "foreground"])
def test_mount_on_a_read_only_nvme(cli_cleanup: Path, foreground: bool) -> None:
    """One line naming NVME and why, not `mount failed: ckptfs: error: NVME/ckptfs.log: ...`
    from the daemon's first write."""
    nvme, ro, shared, mnt = dirs(cli_cleanup, "nvme", "ro", "shared", "mnt")
    subprocess.run(["mount", "--bind", nvme, ro], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", ro], check=True)
        res = run_cli("mount", ro, shared, mnt, *(["--foreground"] if foreground else []),
                      timeout=60)
        line = assert_error_line(res, "not writable", "read-only")
        assert str(ro) in line, line
    finally:
        subprocess.run(["umount", ro], check=False)
    assert fuse_mounts_under(cli_cleanup) == []
    assert os.listdir(nvme) == [], "something was written to NVME"


@pytest.mark.parametrize("inside", ["nvme", "shared", "cold"])
def test_a_directory_inside_the_mount_point_is_refused(cli_cleanup: Path, inside: str) -> None:
    """The daemon would reach NVME, SHARED or the cold tier through its own mount, hidden
    under it, and wait for itself: the mount used to come up and then hang."""
    root = cli_cleanup
    (mnt,) = dirs(root, "mnt")
    paths = {n: (mnt if n == inside else root) / n for n in ("nvme", "shared", "cold")}
    dirs(root, *(str(p.relative_to(root)) for p in paths.values()))
    (root / "link").symlink_to(mnt)  # also when it is named through a symlink
    paths[inside] = root / "link" / inside
    res = run_cli("mount", paths["nvme"], paths["shared"], mnt, "--cold", paths["cold"],
                  "--keep-shared", "1", timeout=60)
    line = assert_error_line(res, "inside", "mount")
    assert str(paths[inside]) in line, line
    assert fuse_mounts_under(root) == []
    wait_for(lambda: no_daemon_for(root), 10, "no daemon to be left")


@pytest.mark.parametrize("where", ["nvme", "nvme/segments", "shared/ckptfs",
                                   "shared/ckptfs/objects", "cold/ckptfs"])
def test_a_mount_point_that_would_hide_a_store_of_its_own_is_refused(cli_cleanup: Path,
                                                                      where: str) -> None:
    """The other way round: MOUNTPOINT inside NVME, or over the store SHARED or the cold tier
    keeps (SHARED/ckptfs). The mount came up, hid the daemon's segments or objects from it,
    and its drain failed for good (`wait` and `umount` never returned)."""
    root = cli_cleanup
    nvme, shared, cold = dirs(root, "nvme", "shared", "cold")
    (mnt,) = dirs(root, where + "/mnt")
    res = run_cli("mount", nvme, shared, mnt, "--cold", cold, "--keep-shared", "1",
                  timeout=60)
    line = assert_error_line(res, "inside", "mountpoint")
    assert str(mnt) in line, line
    assert fuse_mounts_under(root) == []
    wait_for(lambda: no_daemon_for(root), 10, "no daemon to be left")


@pytest.mark.parametrize("link", [False, True], ids=["same", "symlink"])
def test_a_cold_tier_that_is_shared_itself_is_refused(cli_cleanup: Path, link: bool) -> None:
    """--cold SHARED: a move to the cold tier took the shared object for the cold copy, then
    deleted "the shared copy", the only one: older checkpoints read EIO and export failed."""
    root = cli_cleanup
    nvme, shared, mnt = dirs(root, "nvme", "shared", "mnt")
    cold = shared
    if link:
        cold = root / "cold-link"
        cold.symlink_to(shared)
    res = run_cli("mount", nvme, shared, mnt, "--cold", cold, "--keep-shared", "1",
                  timeout=60)
    assert_error_line(res, "cold", "shared")
    assert fuse_mounts_under(root) == []
    wait_for(lambda: no_daemon_for(root), 10, "no daemon to be left")


def test_paths_with_spaces_and_non_ascii_names(cli_cleanup: Path) -> None:
    """/proc/mounts holds a path's bytes as they are (only space, tab, newline and backslash
    escaped): `mount` read them back mangled, never saw its mount come up, and failed with
    `did not become usable`. A path that is not valid UTF-8 gets one line."""
    nvme, shared, mnt = dirs(cli_cleanup, "nv me", "shared ä", "mnt ü\\x")
    res = run_cli("mount", nvme, shared, mnt, timeout=60)
    assert res.rc == 0, str(res)
    assert is_mounted(mnt)
    (mnt / "f").write_bytes(b"data")
    assert run_cli("wait", mnt / "f", timeout=60).rc == 0
    assert run_cli("status", mnt).rc == 0
    assert run_cli("umount", mnt, timeout=60).rc == 0
    assert not is_mounted(mnt, None)
    bad = os.fsencode(cli_cleanup) + b"/mnt\xff"
    os.mkdir(bad)
    res = run_cli("mount", nvme, shared, os.fsdecode(bad), timeout=60)
    assert_error_line(res, "utf-8")
    assert fuse_mounts_under(cli_cleanup) == []


def test_the_daemon_runs_in_root_and_takes_relative_paths_as_the_caller_meant(
        cli_cleanup: Path) -> None:
    """The background daemon kept the caller's working directory, so the filesystem
    `ckptfs mount` was run from could not be unmounted while ckptfs was mounted. It now runs
    in /; relative NVME, SHARED, MOUNTPOINT, --cold and --log-file still mean the caller's."""
    root = cli_cleanup
    dirs(root, "nvme", "shared", "cold", "mnt")
    res = subprocess.run(ckptfs_cmd("mount", "nvme", "shared", "mnt", "--cold", "cold",
                                    "--keep-shared", "1", "--log-file", "daemon.log"),
                         cwd=root, capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    (pid,) = [p for p in pids_with_arg(str(root / "mnt")) if pid_alive(p)]
    assert os.readlink(f"/proc/{pid}/cwd") == "/"
    (root / "mnt" / "f").write_bytes(b"x")
    assert run_cli("wait", root / "mnt" / "f").rc == 0
    assert (root / "daemon.log").stat().st_size > 0
    assert list((root / "shared" / "ckptfs" / "objects").iterdir())
    assert run_cli("umount", root / "mnt").rc == 0


def test_mount_and_umount_through_a_symlink_to_the_mount_point(cli_cleanup: Path) -> None:
    """The kernel mounts on what a symlink names; `mount` used to poll the symlink's own path
    in /proc/mounts, report `did not become usable` and leave the daemon and its mount."""
    nvme, shared, mnt = dirs(cli_cleanup, "nvme", "shared", "mnt")
    (cli_cleanup / "sub").mkdir()
    (cli_cleanup / "sub" / "hop").symlink_to("../mnt")
    link = cli_cleanup / "link"
    link.symlink_to("sub/hop")
    res = run_cli("mount", nvme, shared, str(link) + "/", timeout=60)
    assert res.rc == 0, str(res)
    assert f"mounted {mnt} " in res.out, res.out
    assert is_mounted(mnt)
    (link / "f").write_bytes(b"through the link")
    assert run_cli("status", link).rc == 0
    assert_error_line(run_cli("mount", nvme, shared, link, timeout=60), "already")
    res = run_cli("umount", link, timeout=60)
    assert res.rc == 0, str(res)
    assert not is_mounted(mnt, None)
    assert run_cli("mount", nvme, shared, mnt, timeout=60).rc == 0
    assert (mnt / "f").read_bytes() == b"through the link"
    assert run_cli("umount", mnt, timeout=60).rc == 0


def test_mount_onto_a_live_mount(make_mount: MakeMount, tmp_path: Path) -> None:
    m = make_mount()
    (m.mnt / "keep").write_bytes(b"still here")
    nvme2, shared2 = dirs(tmp_path, "nvme2", "shared2")
    res = run_cli("mount", nvme2, shared2, m.mnt)
    assert_error_line(res, "mount")
    assert wait_for(lambda: no_daemon_for(nvme2), 10, "refused daemon to exit")
    # The live mount is untouched and there is only one mount at that point.
    assert (m.mnt / "keep").read_bytes() == b"still here"
    assert [r for r in fuse_mounts_under(tmp_path) if r == str(m.mnt)] == [str(m.mnt)]
    assert m.alive


@pytest.mark.parametrize("foreground", [False, True], ids=["daemon", "foreground"])
def test_second_daemon_on_the_same_nvme_is_refused(make_mount: MakeMount, tmp_path: Path,
                                                   foreground: bool) -> None:
    m = make_mount()
    (m.mnt / "keep").write_bytes(b"still here")
    (mnt2,) = dirs(tmp_path, "mnt2")
    res = run_cli("mount", m.nvme, m.shared, mnt2, *(["--foreground"] if foreground else []))
    assert_error_line(res, "lock|in use|busy|already")
    assert not is_mounted(mnt2, None)
    wait_for(lambda: no_daemon_for(mnt2), 10, "refused daemon to exit")
    assert (m.mnt / "keep").read_bytes() == b"still here"
    (m.mnt / "more").write_bytes(b"x")
    m.remount()
    assert (m.mnt / "more").read_bytes() == b"x"


def test_a_mount_waits_for_an_unmounted_daemon_still_shutting_down(make_mount: MakeMount,
                                                                   tmp_path: Path) -> None:
    """`umount /ckpt && mount /ckpt` (a service restart, xfstests between tests): the old
    daemon may still be closing its log and index after the unmount. The new mount waits for
    its lock instead of failing with "in use"."""
    m = make_mount()
    (m.mnt / "keep").write_bytes(b"before the restart")
    assert m.proc is not None
    (mnt2,) = dirs(tmp_path, "mnt2")
    m.proc.send_signal(signal.SIGSTOP)  # a daemon slow to shut down, holding the lock
    try:
        assert fusermount(m.mnt, "-uz").returncode == 0  # unmounted from outside
        second = subprocess.Popen(ckptfs_cmd("mount", m.nvme, m.shared, mnt2),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2.0)
        assert second.poll() is None, f"gave up at once: {second.communicate()}"
    finally:
        m.proc.send_signal(signal.SIGCONT)  # it sees the unmount, finishes and exits
    try:
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
        assert "waiting for ckptfs daemon" in (m.nvme / "ckptfs.log").read_text()
        assert (mnt2 / "keep").read_bytes() == b"before the restart"
        assert m.proc.wait(timeout=30) == 0
    finally:
        if is_mounted(mnt2):
            run_cli("umount", mnt2, "--no-drain")
        lazy_unmount_all_under(tmp_path / "mnt2")


def test_stale_mount_is_cleaned_up_and_remounted(make_mount: MakeMount, cli_cleanup: Path
                                                 ) -> None:
    m = make_mount()
    with open(m.mnt / "before-crash", "wb") as f:
        f.write(b"acknowledged")
        os.fsync(f.fileno())
    m.kill()
    assert is_mounted(m.mnt) and listdir_errno(m.mnt) == errno.ENOTCONN
    res = run_cli("mount", m.nvme, m.shared, m.mnt)
    assert res.rc == 0, str(res)
    assert "Traceback" not in res.out + res.err
    assert is_mounted(m.mnt) and listdir_errno(m.mnt) == 0
    assert (m.mnt / "before-crash").read_bytes() == b"acknowledged"
    res = run_cli("umount", m.mnt)
    assert res.rc == 0, str(res)
    assert not is_mounted(m.mnt, None)
    assert no_daemon_for(m.mnt), "ckptfs umount returned before the daemon exited"


def test_status_and_wait_on_a_dead_mount_name_it(make_mount: MakeMount) -> None:
    """After a SIGKILL of the daemon, `status` said "not inside a ckptfs mount" and `wait`
    "no such file or directory" (as if the data were gone): both now name the dead mount
    and the fix, and the Python API raises the same."""
    m = make_mount()
    (m.mnt / "step_1").mkdir()
    (m.mnt / "step_1" / "f").write_bytes(b"x")
    m.kill()
    for args in (("status", m.mnt), ("wait", m.mnt / "step_1"), ("wait", m.mnt)):
        line = assert_error_line(run_cli(*args), "dead", "ckptfs mount")
        assert str(m.mnt) in line, line
    import ckptfs

    with pytest.raises(ckptfs.CkptfsError, match="dead ckptfs mount"):
        ckptfs.status(m.mnt / "step_1")


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "no-drain"])
def test_daemonized_mount_returns_when_usable_and_umount_waits(cli_cleanup: Path, drain: bool
                                                               ) -> None:
    nvme, shared, mnt = dirs(cli_cleanup, "nvme", "shared", "mnt")
    # Pipes on purpose: a daemon that kept the parent's stdout/stderr would hang this call.
    try:
        res = subprocess.run(ckptfs_cmd("mount", nvme, shared, mnt), stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("`ckptfs mount` did not return in 60 s, or its daemon kept stdout/stderr "
                    "open (a pipe reader waits for every writer to close)")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    # Usable at the moment it returned: no waiting here.
    row = mount_entry(mnt)
    assert row is not None and row[2] == FSTYPE and row[0] == "ckptfs", row
    assert listdir_errno(mnt) == 0
    (mnt / "f").write_bytes(b"data")
    res2 = run_cli("umount", mnt, *([] if drain else ["--no-drain"]), timeout=30)
    assert res2.rc == 0, str(res2)
    assert not is_mounted(mnt, None)
    assert no_daemon_for(nvme), "ckptfs umount returned before the daemon exited"
    # And the data is there on the next mount.
    res3 = run_cli("mount", nvme, shared, mnt)
    assert res3.rc == 0, str(res3)
    assert (mnt / "f").read_bytes() == b"data"
    res4 = run_cli("umount", mnt, *([] if drain else ["--no-drain"]), timeout=30)
    assert res4.rc == 0, str(res4)
    assert not is_mounted(mnt, None)


def test_umount_with_timeout_0_never_kills_a_healthy_daemon(cli_cleanup: Path) -> None:
    """`umount --timeout 0` gave the liveness probe 0 s too: a healthy daemon was called
    hung, SIGKILLed and its mount detached, with exit 0 and no drain. Now the drain times
    out (exit 1) and the mount stays, as documented."""
    nvme, shared, mnt = dirs(cli_cleanup, "nvme", "shared", "mnt")
    assert run_cli("mount", nvme, shared, mnt, "--seal-idle", "600").rc == 0
    pids = [p for p in pids_with_arg(str(mnt)) if pid_alive(p)]
    (mnt / "step_1").mkdir()
    (mnt / "step_1" / "f").write_bytes(os.urandom(1 << 20))
    line = assert_error_line(run_cli("umount", "--timeout", "0", mnt), "drain", "timed out")
    assert "--no-drain" in line, line
    assert is_mounted(mnt) and all(pid_alive(p) for p in pids), "the daemon was killed"
    assert (mnt / "step_1" / "f").stat().st_size == 1 << 20
    res = run_cli("umount", mnt)
    assert res.rc == 0, str(res)
    assert not is_mounted(mnt, None)


@pytest.mark.parametrize("foreground", [False, True], ids=["daemon", "foreground"])
def test_a_refused_first_mount_leaves_the_nvme_directory_as_it_was(cli_cleanup: Path,
                                                                    foreground: bool) -> None:
    """A first mount refused late (its metrics port taken) had already bound NVME to its
    --node-id: the corrected command, with another id, was then refused (`NVME belongs to
    node 'typo1'`). A failed first mount now leaves NVME as it found it, but for its log."""
    import socket

    nvme, shared, mnt = dirs(cli_cleanup, "nvme", "shared", "mnt")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["mount", nvme, shared, mnt, "--node-id", "typo1", "--metrics-port", str(port)]
        if foreground:  # its log goes to stderr too
            res = run_cli(*args, "--foreground")
            assert res.rc == 1 and "ckptfs: error: cannot serve metrics" in res.err, str(res)
        else:
            assert_error_line(run_cli(*args), "metrics", str(port))
    assert not is_mounted(mnt, None)
    assert [n for n in os.listdir(nvme) if not n.endswith(".log")] == []
    res = run_cli("mount", nvme, shared, mnt, "--node-id", "n0")
    assert res.rc == 0, str(res)
    assert run_cli("umount", mnt).rc == 0


def test_mount_with_a_long_nvme_path(cli_cleanup: Path) -> None:
    # Real NVME paths can be long (and pytest's are); AF_UNIX socket paths cannot exceed 107
    # bytes, so nothing the daemon binds may be placed naively under NVME.
    deep = cli_cleanup / ("n" * 60) / ("v" * 60) / "nvme"
    nvme, shared, mnt = dirs(cli_cleanup, str(deep.relative_to(cli_cleanup)), "shared", "mnt")
    assert len(str(nvme)) > 160
    res = run_cli("mount", nvme, shared, mnt)
    assert "Traceback" not in res.out + res.err, str(res)
    assert res.rc == 0, str(res)
    assert listdir_errno(mnt) == 0
    assert run_cli("umount", mnt).rc == 0


# -- umount ------------------------------------------------------------------------------------


def test_umount_of_a_plain_directory(tmp_path: Path) -> None:
    (d,) = dirs(tmp_path, "plain")
    assert_error_line(run_cli("umount", d), "mount")


def test_umount_of_a_missing_path(tmp_path: Path) -> None:
    assert_error_line(run_cli("umount", tmp_path / "nope"))


def test_umount_of_a_foreign_mount_leaves_it_alone(tmp_path: Path) -> None:
    (d,) = dirs(tmp_path, "tmpfs")
    if subprocess.run(["mount", "-t", "tmpfs", "none", str(d)], capture_output=True,
                      check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (d / "x").write_bytes(b"x")
        assert_error_line(run_cli("umount", d), "ckptfs")
        assert is_mounted(d, "tmpfs"), "ckptfs umount unmounted a tmpfs"
        assert (d / "x").read_bytes() == b"x"
    finally:
        subprocess.run(["umount", str(d)], check=False)


# -- replay ------------------------------------------------------------------------------------


@pytest.mark.parametrize("json_flag", [False, True], ids=["text", "json"])
def test_replay_on_an_nvme_locked_by_a_live_daemon(mount: Mount, json_flag: bool) -> None:
    (mount.mnt / "f").write_bytes(b"live")
    res = run_cli("replay", mount.nvme, *(["--json"] if json_flag else []))
    assert_error_line(res, "lock|in use|busy|running")
    assert (mount.mnt / "f").read_bytes() == b"live"
    mount.remount()
    assert (mount.mnt / "f").read_bytes() == b"live"


def test_replay_rebuilds_a_damaged_index_which_a_mount_names(mount: Mount) -> None:
    """The index (NVME/index/data.mdb) damaged: the mount fails with one line that names the
    fix, and `ckptfs replay`, that fix, rebuilds it from the log (it died with a traceback
    opening the damaged index it was about to rebuild anyway)."""
    (mount.mnt / "d").mkdir()
    (mount.mnt / "d/f").write_bytes(b"kept" * 1000)
    mount.unmount()
    with open(mount.nvme / "index" / "data.mdb", "r+b") as f:
        f.write(os.urandom(8192))
    res = run_cli("mount", mount.nvme, mount.shared, mount.mnt, timeout=60)
    assert_error_line(res, "index", "ckptfs replay")
    assert not is_mounted(mount.mnt)
    res = run_cli("replay", mount.nvme)
    assert res.rc == 0 and "Traceback" not in res.err, str(res)
    mount.start()
    assert (mount.mnt / "d/f").read_bytes() == b"kept" * 1000


def test_replay_of_a_missing_nvme(tmp_path: Path) -> None:
    assert_error_line(run_cli("replay", tmp_path / "nope"))


@pytest.mark.parametrize("content", ["[1, 2]", '{"shared": 5}', '{"first_segment": "x"}',
                                     "{not json"])
def test_replay_and_mount_with_a_damaged_identity_file(tmp_path: Path, content: str) -> None:
    """NVME/ckptfs.json (which node the directory belongs to, where it published) that is
    not what a mount wrote: one error line from replay and mount, no traceback."""
    nvme = tmp_path / "nvme"
    (nvme / "segments").mkdir(parents=True)
    (nvme / "ckptfs.json").write_text(content)
    assert_error_line(run_cli("replay", nvme), "ckptfs.json")
    for d in ("shared", "mnt"):
        (tmp_path / d).mkdir()
    assert_error_line(run_cli("mount", nvme, tmp_path / "shared", tmp_path / "mnt"),
                      "ckptfs.json")


# -- usage errors ------------------------------------------------------------------------------

USAGE_ERROR = re.compile(r"^ckptfs(?: [a-z-]+)?: error: ")


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["mount"],
        ["mount", "a", "b"],
        ["mount", "a", "b", "c", "--bogus"],
        ["mount", "a", "b", "c", "--segment-size", "banana"],
        ["mount", "a", "b", "c", "--seal-idle", "soon"],
        ["mount", "a", "b", "c", "--seal-idle", "0"],  # the idle check would spin
        ["mount", "a", "b", "c", "--refresh-interval", "0"],  # SHARED listed without a pause
        ["mount", "a", "b", "c", "--nodes", "-1"],
        ["mount", "a", "b", "c", "--keep-shared", "-2"],
        ["mount", "a", "b", "c", "--keep-sh", "2"],  # no abbreviations: scripts say what they mean
        ["status", "a", "--js"],
        ["ls", "a", "--nodes", "-1"],
        ["mount", "a", "b", "c", "--retain", "run/step_*"],  # a name glob, not a path
        ["ls", "a", "--marker", ""],
        ["umount"],
        ["umount", "a", "b"],
        ["replay"],
        ["replay", "a", "--bogus"],
    ],
    ids=lambda a: " ".join(a) or "no-args",
)
@pytest.mark.parametrize("console", [False, True], ids=["python-m", "console-script"])
def test_usage_errors_exit_2(args: list[str], console: bool) -> None:
    res = run_cli(*args, console=console)
    assert "Traceback" not in res.out + res.err, str(res)
    assert res.rc == 2, str(res)
    lines = res.err.strip().splitlines()
    assert lines and USAGE_ERROR.match(lines[-1]), (
        f"last stderr line should be `ckptfs ...: error: ...` (also under python -m): {res}")


def test_a_malformed_tuning_variable_is_one_warning_not_a_traceback(
        cli_cleanup: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CKPTFS_SHARED_TIMEOUT=30s (the knob for a hung NAS, with a unit) crashed every command
    at import time, `--help` and `umount` included; the others crashed `mount`. Each is now
    one warning line, the default is used, and the command works."""
    bad = {"CKPTFS_SHARED_TIMEOUT": "30s", "CKPTFS_READ_AHEAD": "8M", "CKPTFS_EXIT_GRACE": "-1",
           "CKPTFS_GROUP_YIELDS": "two"}
    for k, v in bad.items():
        monkeypatch.setenv(k, v)
    res = run_cli("--help")
    assert res.rc == 0 and "Traceback" not in res.err, str(res)
    assert res.err.strip() == ("ckptfs: warning: ignoring CKPTFS_SHARED_TIMEOUT='30s': not a "
                               "number of seconds of at least 0; using 30.0"), res.err
    nvme, shared, mnt = dirs(cli_cleanup, "nvme", "shared", "mnt")
    res = run_cli("mount", nvme, shared, mnt)
    assert res.rc == 0 and "Traceback" not in res.err, str(res)
    warnings = res.err.strip().splitlines()
    assert len(warnings) == len(bad), res.err
    for k, v in bad.items():
        assert any(w.startswith(f"ckptfs: warning: ignoring {k}={v!r}") for w in warnings), k
    (mnt / "f").write_bytes(b"data")
    res = run_cli("umount", mnt)
    assert res.rc == 0 and "Traceback" not in res.err, str(res)
    assert not is_mounted(mnt, None)


def test_wait_all_nodes_before_path_as_the_synopsis_writes_it(mount: Mount) -> None:
    """`wait --all-nodes PATH` (cli.md's synopsis) was refused: argparse took PATH for N."""
    (mount.mnt / "step_1").mkdir()
    line = assert_error_line(run_cli("wait", "--all-nodes", mount.mnt / "step_1"),
                             "needs a node count")
    assert "--nodes" in line, line
    res = run_cli("wait", "--all-nodes", "x", "y")
    assert res.rc == 2 and "not a whole number: 'x'" in res.err, str(res)
    res = run_cli("wait", "--all-nodes")
    assert res.rc == 2 and "required: PATH" in res.err, str(res)


def test_help_exits_0() -> None:
    for argv in (["--help"], ["mount", "--help"], ["umount", "--help"], ["replay", "--help"]):
        res = run_cli(*argv)
        assert res.rc == 0, str(res)
        assert "usage: ckptfs" in res.out, str(res)


@pytest.mark.parametrize("extra,words", [
    (["--segment-size", "65G"], "at most 64g"),
    (["--segment-size", "64M", "--cache-size", "100M"], "half of --cache-size"),
])
def test_mount_with_a_segment_size_out_of_range(tmp_path: Path, extra: list[str],
                                                words: str) -> None:
    for d in ("nvme", "shared", "mnt"):
        (tmp_path / d).mkdir()
    res = run_cli("mount", tmp_path / "nvme", tmp_path / "shared", tmp_path / "mnt", *extra)
    assert_error_line(res, words)
    assert not os.listdir(tmp_path / "nvme")  # refused before anything was written there
