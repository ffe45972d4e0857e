"""Power loss, against a real ext4 that really loses what was never flushed.

NVME (or SHARED) lives on an ext4 filesystem in a loop-mounted image file. "Power loss" is a
copy of the image taken while that filesystem is still mounted, once nothing writes to it any
more: the copy holds exactly the blocks ext4 has sent to its device so far, which is what a
device that never drops a completed write would hold if the power failed at that instant.
Whatever lived only in the page cache (data never fsync'd, a journal transaction never
committed) is not in it. The copy is then mounted, ext4 replays its journal as after a reboot,
and ckptfs starts on it.

The model loses less than real hardware does (no volatile disk cache, no reordered writes), so
these tests show that a flush is missing, not that flushes come in the right order for every
device. The image is mounted with `commit=600` so ext4's periodic journal commit (5 s by default)
cannot make unsynced work durable behind the test's back, and every test first checks that a
file written without fsync is really lost from its copy: otherwise it would prove nothing.

What they check is the promise (docs/architecture.md, section 11):
- `fsync(fd)` makes that file survive a power loss of the node; what was not fsync'd may be lost,
  but never comes back as wrong bytes.
- once `ckptfs wait PATH` returned, PATH survives a power loss of the shared store: readable by
  `ckptfs export` and by a node that never had it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from mounting import MakeMount, Mount, run_cli, wait_for

from ckptfs.layout import fsync_dir

IMAGE_SIZE = 16 << 30  # sparse: only what ext4 writes takes space (a long run fills gigabytes)
CANARY = b"written without fsync, must be lost\n" * 4096


def _have(tool: str) -> bool:
    return shutil.which(tool) is not None


pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or not (_have("mkfs.ext4") and _have("mount") and _have("umount")),
        reason="needs root, mkfs.ext4 and loop devices",
    ),
    # Alone, never beside other tests (scripts/test.sh runs these after the parallel run): a
    # sync() or the kernel's writeback under another test's load flushes the loop filesystem
    # too, and what a power loss must take would be on the "device" already.
    pytest.mark.serial,
]


class LoopExt4:
    """An ext4 filesystem in an image file, loop-mounted at `mnt` (the loop device goes away
    with the unmount: mount -o loop sets autoclear)."""

    def __init__(self, image: Path, mnt: Path, *, fresh: bool) -> None:
        self.image, self.mnt = image, mnt
        if fresh:
            with open(image, "wb") as f:
                f.truncate(IMAGE_SIZE)
            # few, big files: a small inode table and journal, written whole now (no lazy
            # init writing behind the test's back)
            subprocess.run(["mkfs.ext4", "-q", "-F", "-i", str(1 << 20), "-J", "size=32", "-E",
                            "lazy_itable_init=0,lazy_journal_init=0", str(image)],
                           check=True, capture_output=True)
        mnt.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["mount", "-t", "ext4", "-o", "loop,commit=600", str(image),
                              str(mnt)], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            pytest.skip(f"cannot loop-mount an ext4 image: {res.stderr.strip()}")
        self.mounted = True

    def unmount(self) -> None:
        if self.mounted:
            res = subprocess.run(["umount", str(self.mnt)], capture_output=True, check=False)
            if res.returncode != 0:  # something still holds it: detach it anyway
                subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True,
                               check=False)
            self.mounted = False


@pytest.fixture
def loop_fs(tmp_path: Path) -> Iterator[list[LoopExt4]]:
    """Registry of loop filesystems made by a test; all unmounted after it (after its ckptfs
    mounts: this fixture is set up before make_mount, so it is torn down after it)."""
    made: list[LoopExt4] = []
    yield made
    for fs in reversed(made):
        fs.unmount()


def make_fs(made: list[LoopExt4], tmp_path: Path, name: str) -> LoopExt4:
    fs = LoopExt4(tmp_path / f"{name}.img", tmp_path / name, fresh=True)
    made.append(fs)
    return fs


def crash(made: list[LoopExt4], fs: LoopExt4, tmp_path: Path, name: str) -> LoopExt4:
    """The power goes: copy the device as it is now (nothing flushed first), take the old
    filesystem away, and boot the copy (`name`.img) at the same mountpoint."""
    image = tmp_path / f"{name}.img"
    subprocess.run(["cp", "--sparse=always", str(fs.image), str(image)], check=True)
    fs.unmount()
    after = LoopExt4(image, fs.mnt, fresh=False)
    made.append(after)
    return after


def write_canary(fs: LoopExt4) -> None:
    with open(fs.mnt / "canary", "wb") as f:
        f.write(CANARY)  # no fsync


def assert_canary_lost(fs: LoopExt4) -> None:
    """The copy must have lost an unsynced file, or the crash model kept unsynced data and the
    test around it could not fail."""
    path = fs.mnt / "canary"
    if path.exists():
        assert path.read_bytes() != CANARY, (
            "a file written without fsync survived the simulated power loss: the crash model "
            "does not drop unsynced data here, so this test would prove nothing")


def content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def write_file(path: Path, data: bytes, *, fsync: bool, chunk: int = 1 << 20) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(data), chunk):
            os.write(fd, data[i:i + chunk])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def lost_or_prefix(got: bytes, want: bytes) -> bool:
    """What may be left of a file whose writes were never fsync'd: a size no larger than what
    was written, each 4 KiB block either the written bytes or zeros (a hole whose data was
    lost). Anything else is wrong bytes."""
    if len(got) > len(want):
        return False
    for i in range(0, len(got), 4096):
        g = got[i:i + 4096]
        if g != want[i:i + len(g)] and g.count(0) != len(g):
            return False
    return True


# Sizes that take every path of the log: empty, a small buffered record, records just below
# and above the O_DIRECT threshold (128 KiB), one 1 MiB FUSE request and several.
SIZES = [0, 1, 5000, 128 * 1024 - 1, 128 * 1024 + 7, (1 << 20) + 123, 3 * (1 << 20) + 4095]


def mount_on(make_mount: MakeMount, name: str, *, nvme: Path | None = None,
             shared: Path | None = None, args: tuple[str, ...] = (),
             env: dict[str, str] | None = None) -> Mount:
    m = make_mount(name, extra_args=args, start=False)
    if env:
        m.env = {**os.environ, **env}
    if nvme is not None:
        m.nvme = nvme
    if shared is not None:
        m.shared = shared
    m.nvme.mkdir(parents=True, exist_ok=True)
    m.shared.mkdir(parents=True, exist_ok=True)
    m.start()
    return m


# Nothing seals or drains before the power loss: everything fsync'd is only in the local log.
HOLD_LOCAL = ("--seal-idle", "3600", "--segment-size", "128M", "--cache-size", "512M")


@pytest.mark.parametrize("buffered", ["1", "0"])
def test_fsynced_files_survive_power_loss_of_the_node(
        loop_fs: list[LoopExt4], make_mount: MakeMount, tmp_path: Path, buffered: str) -> None:
    """Big data records go through the page cache by default, and to the disk with O_DIRECT
    while the disk is behind (or with CKPTFS_BUFFERED_WRITES=0): the fsync of either kind
    must make them durable."""
    nvme_fs = make_fs(loop_fs, tmp_path, "nvme-disk")
    shared = tmp_path / "shared"
    m = mount_on(make_mount, "before", nvme=nvme_fs.mnt / "nvme", shared=shared, args=HOLD_LOCAL,
                 env={"CKPTFS_BUFFERED_WRITES": buffered})
    synced, unsynced = m.mnt / "synced", m.mnt / "unsynced"
    synced.mkdir()
    unsynced.mkdir()
    fsync_dir(m.mnt)
    want: dict[str, bytes] = {}
    for i, size in enumerate(SIZES):
        want[f"f{i}"] = content(i, size)
        write_file(synced / f"f{i}", want[f"f{i}"], fsync=True)
    # rewritten in place, then cut shorter: the last state is what was fsync'd
    data = bytearray(content(100, 2 << 20))
    write_file(synced / "rewritten", bytes(data), fsync=False)
    with open(synced / "rewritten", "r+b") as f:
        patch = content(101, 300_000)
        f.seek(700_000)
        f.write(patch)
        data[700_000:700_000 + len(patch)] = patch
        f.truncate(1_500_000)
        del data[1_500_000:]
        f.flush()
        os.fsync(f.fileno())
    want["rewritten"] = bytes(data)
    # temp name, fsync, rename, fsync the directory: the final name must be there
    want["renamed"] = content(102, 600_000)
    write_file(synced / "renamed.tmp", want["renamed"], fsync=True)
    os.rename(synced / "renamed.tmp", synced / "renamed")
    fsync_dir(synced)
    # one file written alone, long enough to pass a kick of its writeback (log.KICK)
    want["alone"] = content(103, (24 << 20) + 5)
    write_file(synced / "alone", want["alone"], fsync=True)
    # written after the last fsync, never fsync'd: may be lost, never wrong
    maybe: dict[str, bytes] = {}
    for i, size in enumerate([*SIZES[1:], 20 << 20], 200):
        maybe[f"u{i}"] = content(i, size)
        write_file(unsynced / f"u{i}", maybe[f"u{i}"], fsync=False)
    status = json.loads(run_cli("status", m.mnt, "--json").out)
    if buffered == "1":
        assert status["log_records_buffered"] >= 24, status
    else:
        assert status["log_records_buffered"] == 0 and status["log_direct_records"] >= 24, status

    write_canary(nvme_fs)
    m.kill()  # the node loses power: the daemon dies with it...
    m.clean_stale()
    after = crash(loop_fs, nvme_fs, tmp_path, "nvme-disk-after")  # ...and so does the page cache
    assert_canary_lost(after)
    assert not any(shared.rglob("*.seg")), "a segment was published: the test needs them local"

    m2 = mount_on(make_mount, "after", nvme=after.mnt / "nvme", shared=shared, args=HOLD_LOCAL)
    s2 = m2.mnt / "synced"
    assert sorted(os.listdir(s2)) == sorted(want), "fsync'd names lost or renamed back"
    for name, data in want.items():
        got = (s2 / name).read_bytes()
        assert got == data, f"synced/{name}: {len(got)} bytes back, {len(data)} fsync'd"
    u2 = m2.mnt / "unsynced"
    for name in os.listdir(u2) if u2.exists() else []:
        got = (u2 / name).read_bytes()
        assert lost_or_prefix(got, maybe[name]), f"unsynced/{name}: wrong bytes after replay"
    # and the recovered node goes on working: what it recovered is published
    res = run_cli("wait", m2.mnt, timeout=120)
    assert res.rc == 0, res


def write_checkpoint(root: Path, seed: int) -> dict[str, bytes]:
    """A small multi-rank checkpoint (no fsync: `wait` is what makes it durable)."""
    root.mkdir()
    files = {f"__{r}_0.distcp": content(seed + r, size) for r, size in enumerate(SIZES)}
    files[".metadata"] = content(seed + 99, 3000)
    for name, data in files.items():
        write_file(root / name, data, fsync=False)
    return files


def test_waited_checkpoint_survives_power_loss_of_the_shared_store(
        loop_fs: list[LoopExt4], make_mount: MakeMount, tmp_path: Path) -> None:
    nas = make_fs(loop_fs, tmp_path, "nas-disk")
    m = mount_on(make_mount, "node", shared=nas.mnt / "shared")
    files = write_checkpoint(m.mnt / "step_1", 1)
    res = run_cli("wait", m.mnt / "step_1", timeout=120)
    assert res.rc == 0, res

    write_canary(nas)
    m.kill()  # nothing more reaches the store; nothing is flushed on the way out either
    m.clean_stale()
    after = crash(loop_fs, nas, tmp_path, "nas-disk-after")
    assert_canary_lost(after)

    shared = after.mnt / "shared"
    res = run_cli("fsck", shared, "--deep")
    assert res.rc == 0, res
    out = tmp_path / "export"
    res = run_cli("export", shared, "step_1", out)
    assert res.rc == 0, res
    for name, data in files.items():
        assert (out / name).read_bytes() == data, f"export of step_1/{name}"
    # a node that never had the data reads it from the store
    other = mount_on(make_mount, "other-node", shared=shared, args=("--node-id", "other"))
    for name, data in files.items():
        assert (other.mnt / "step_1" / name).read_bytes() == data, f"step_1/{name} on node 2"


def test_node_power_loss_after_publishing_loses_nothing_published_and_goes_on(
        loop_fs: list[LoopExt4], make_mount: MakeMount, tmp_path: Path) -> None:
    """Segments published to SHARED, then the node loses power before its own log and index
    were flushed (no application fsync at all): the node comes back with the published
    checkpoint intact, and publishes the next ones (no segment id taken twice, no object
    "already exists" that stalls the drain)."""
    nvme_fs = make_fs(loop_fs, tmp_path, "nvme-disk")
    shared = tmp_path / "shared"
    m = mount_on(make_mount, "before", nvme=nvme_fs.mnt / "nvme", shared=shared)
    step1 = write_checkpoint(m.mnt / "step_1", 1)
    res = run_cli("wait", m.mnt / "step_1", timeout=120)
    assert res.rc == 0, res
    maybe = write_checkpoint(m.mnt / "step_2", 2)  # not waited for, not fsync'd

    write_canary(nvme_fs)
    m.kill()
    m.clean_stale()
    after = crash(loop_fs, nvme_fs, tmp_path, "nvme-disk-after")
    assert_canary_lost(after)

    m2 = mount_on(make_mount, "after", nvme=after.mnt / "nvme", shared=shared)
    for name, data in step1.items():
        assert (m2.mnt / "step_1" / name).read_bytes() == data, f"step_1/{name}"
    step2 = m2.mnt / "step_2"
    for name in os.listdir(step2) if step2.exists() else []:
        got = (step2 / name).read_bytes()
        assert lost_or_prefix(got, maybe[name]), f"step_2/{name}: wrong bytes after replay"
    step3 = write_checkpoint(m2.mnt / "step_3", 3)
    res = run_cli("wait", m2.mnt, timeout=120)
    assert res.rc == 0, res
    m2.unmount()
    res = run_cli("fsck", shared, "--deep")
    assert res.rc == 0, res
    out = tmp_path / "export"
    for step, files in (("step_1", step1), ("step_3", step3)):
        res = run_cli("export", shared, step, out / step)
        assert res.rc == 0, res
        for name, data in files.items():
            assert (out / step / name).read_bytes() == data, f"export of {step}/{name}"


def test_gc_after_a_publish_keeps_the_published_namespace_through_a_power_loss(
        loop_fs: list[LoopExt4], make_mount: MakeMount, tmp_path: Path) -> None:
    """A segment holding only a rename and the segment after it are published together, and
    the published view applies both in one commit, with the manifest. The rename's segment is
    garbage then (no data): GC deletes it, locally and on SHARED. The power goes. LMDB without
    metasync loses its last commit, so the view comes back from before the rename and must
    apply the segments after it again, but one of them is gone. GC makes the view's commit
    durable before it deletes anything (docs/architecture.md section 8). Without that, the
    publisher here retried the deleted object forever and `wait` never returned; in the
    power-loss rounds, where the live index had dropped the segment too, the view skipped it
    and published manifests with the old name."""
    nvme_fs = make_fs(loop_fs, tmp_path, "nvme-disk")
    shared = tmp_path / "shared"
    args = ("--seal-idle", "0.3", "--gc-grace", "0")
    m = mount_on(make_mount, "before", nvme=nvme_fs.mnt / "nvme", shared=shared, args=args)
    d = m.mnt / "ckpt"
    d.mkdir()
    want = {"a": content(1, 300_000), "c": content(3, 200_000)}
    write_file(d / "a.tmp", want["a"], fsync=True)
    res = run_cli("wait", m.mnt, timeout=120)
    assert res.rc == 0, res
    # the store looks unmounted for a while: the next two segments queue up, and go out as
    # one batch that the view applies in one commit
    fmt_file = shared / "ckptfs" / "FORMAT"
    fmt_file.rename(fmt_file.with_name("FORMAT.away"))
    os.rename(d / "a.tmp", d / "a")
    fsync_dir(d)
    time.sleep(1.0)  # sealed when idle
    write_file(d / "c", want["c"], fsync=True)
    time.sleep(1.0)
    fmt_file.with_name("FORMAT.away").rename(fmt_file)
    res = run_cli("wait", m.mnt, timeout=120)
    assert res.rc == 0, res
    res = run_cli("gc", m.mnt, timeout=120)
    assert res.rc == 0, res
    assert "; 0 segments freed" not in res.out, res.out  # the rename's segment is gone
    # an fsync'd append commits ext4's journal: the deletion is durable, the view's commit is
    # not (its file was not flushed)
    want["e"] = content(4, 1000)
    write_file(d / "e", want["e"], fsync=True)

    write_canary(nvme_fs)
    m.kill()
    m.clean_stale()
    after = crash(loop_fs, nvme_fs, tmp_path, "nvme-disk-after")
    assert_canary_lost(after)

    m2 = mount_on(make_mount, "after", nvme=after.mnt / "nvme", shared=shared, args=args)
    assert sorted(os.listdir(m2.mnt / "ckpt")) == ["a", "c", "e"]
    want["b"] = content(2, 5000)
    write_file(m2.mnt / "ckpt" / "b", want["b"], fsync=False)
    res = run_cli("wait", m2.mnt, timeout=120)
    assert res.rc == 0, res
    m2.unmount()
    out = tmp_path / "export"
    res = run_cli("export", shared, "ckpt", out)
    assert res.rc == 0, res
    assert sorted(os.listdir(out)) == sorted(want), "the published namespace lost the rename"
    for name, data in want.items():
        assert (out / name).read_bytes() == data, name


Content = bytes | tuple[int, bytes]  # the bytes, or (length, xxh3_128) once checked


def digest(data: Content) -> tuple[int, bytes]:
    return data if isinstance(data, tuple) else (len(data), xxhash.xxh3_128_digest(data))


class Writer:
    """Files written, renamed and removed in one directory by a thread, with a journal of what
    each fsync made durable. Runs until the mount dies under it."""

    def __init__(self, d: Path, rnd: random.Random, shared_content: list[bytes]) -> None:
        self.d, self.rnd, self.pool = d, rnd, shared_content
        self.durable: dict[str, Content] = {}  # name -> bytes, as a returned fsync left them
        self.written: dict[str, Content] = {}  # every file's last written bytes, durable or not
        self.in_flight: tuple[str, str, str] | None = None  # (op, name, new name) not returned
        self.ops = 0
        self.go = threading.Event()  # cleared: park between two operations
        self.go.set()
        self.parked = threading.Event()

    def run(self) -> None:
        try:
            while True:
                if not self.go.is_set():
                    self.parked.set()
                    self.go.wait()
                    self.parked.clear()
                self.step()
                self.ops += 1
        except OSError:
            return  # ENOTCONN / ECONNABORTED: the daemon is gone
        finally:
            self.parked.set()

    def waited(self, mnt: Path) -> None:
        """Park the writer, `ckptfs wait` for its directory, and count everything it wrote as
        durable: `wait` promises it is published on SHARED, fsync'd or not."""
        self.go.clear()
        self.parked.wait(60)
        try:
            res = run_cli("wait", self.d, timeout=120)
            if res.rc == 0:
                self.durable = dict(self.written)
        finally:
            self.go.set()

    def step(self) -> None:
        rnd = self.rnd
        roll = rnd.random()
        if roll < 0.15 and self.durable:
            name = rnd.choice(sorted(self.durable))
            new = f"r{self.ops}"
            self.in_flight = ("rename", name, new)
            os.rename(self.d / name, self.d / new)
            self.written[new] = self.written.pop(name)
            fsync_dir(self.d)
            self.durable[new] = self.durable.pop(name)
        elif roll < 0.25 and self.durable:
            name = rnd.choice(sorted(self.durable))
            self.in_flight = ("unlink", name, "")
            os.unlink(self.d / name)
            del self.written[name]
            fsync_dir(self.d)
            del self.durable[name]
        else:
            name = f"f{self.ops}"
            if self.pool and rnd.random() < 0.2:
                data = rnd.choice(self.pool)  # the same bytes again: dedup's REF records
            else:
                data = rnd.randbytes(rnd.choice((0, 1, 3000, 100_000, 300_000, 1 << 20,
                                                 (2 << 20) + 5)))
                self.pool.append(data)
                del self.pool[:-64]
            sync = rnd.random() < 0.6
            self.in_flight = ("create", name, "")
            self.written[name] = data
            write_file(self.d / name, data, fsync=sync)
            if sync:
                self.durable[name] = data
        self.in_flight = None

    def check(self, d: Path) -> list[str]:
        """What is wrong with `d` after a power loss; removes what is not durable, so the next
        round starts from a known state."""
        wrong = []
        found = set(os.listdir(d))
        op = self.in_flight
        for name, data in self.durable.items():
            if op and op[0] == "rename" and op[1] == name and name not in found \
                    and op[2] in found:
                found.discard(op[2])
                got = (d / op[2]).read_bytes()
                os.rename(d / op[2], d / name)
            elif op and op[0] == "unlink" and op[1] == name and name not in found:
                continue
            elif name not in found:
                wrong.append(f"{name}: fsync'd, lost")
                continue
            else:
                got = (d / name).read_bytes()
            found.discard(name)
            if digest(got) != digest(data):
                wrong.append(f"{name}: fsync'd {len(data)} bytes, {len(got)} back, different")
        if op and op[0] == "unlink" and op[1] in self.durable and op[1] not in set(os.listdir(d)):
            del self.durable[op[1]]
        for name in found:  # never fsync'd: may be lost, never wrong
            got = (d / name).read_bytes()
            if name not in self.written:
                wrong.append(f"{name}: back, though its removal or rename was fsync'd")
            elif not (digest(got) == want if isinstance(want := self.written[name], tuple)
                      else lost_or_prefix(got, want)):
                wrong.append(f"{name}: not fsync'd, wrong bytes ({len(got)})")
            os.unlink(d / name)
        fsync_dir(d)
        # what later rounds check: length and hash are enough (a long run would keep gigabytes)
        self.durable = {name: digest(data) for name, data in self.durable.items()}
        self.written = dict(self.durable)
        self.in_flight = None
        return wrong


def power_loss_rounds(loop_fs: list[LoopExt4], make_mount: MakeMount, tmp_path: Path,
                      seed: int, rounds: int, shared_too: bool = False,
                      tiered: bool = False) -> None:
    """Rounds of: mount on the disk the last power loss left, check every directory written so
    far, write with a thread for a random while (the drain publishing small segments at the
    same time, `evict --all`, `gc --compact` and `wait` run now and then), cut the power: of
    the node, and with `shared_too` of the shared store at the same instant. Now and then the
    power goes again right after a mount, while it still publishes what recovery found.

    `tiered`: each writer's directory is a checkpoint, complete (a DONE marker, fsync'd) once
    a round has checked it; the newest one stays on NVMe and on SHARED, the older ones move to
    a cold tier (on the store's disk), and must read back the same from there."""
    rnd = random.Random(seed)
    args: tuple[str, ...] = ("--segment-size", os.environ.get("CKPTFS_POWER_SEGMENT", "4M"),
                             "--seal-idle", "0.2")
    disk = make_fs(loop_fs, tmp_path, "disk-0")
    nas = make_fs(loop_fs, tmp_path, "nas-0") if shared_too else None
    if tiered:
        cold = (nas.mnt if nas is not None else tmp_path) / "cold"
        cold.mkdir()
        args += ("--retain", "w*", "--marker", "DONE", "--keep-local", "1", "--keep-shared", "1",
                 "--cold", str(cold))
    writers: list[Writer] = []
    pool: list[bytes] = []

    def shared() -> Path:
        return nas.mnt / "shared" if nas is not None else tmp_path / "shared"

    for r in range(rounds):
        m = mount_on(make_mount, f"round-{r}", nvme=disk.mnt / "nvme", shared=shared(),
                     args=args)
        if r and rnd.random() < 0.15:
            # the power goes again while the mount is still publishing what recovery found
            time.sleep(rnd.uniform(0, 0.3))
            m.kill()
            m.clean_stale()
            disk = power_cycle(loop_fs, disk, tmp_path, f"disk-{r + 1}")
            if nas is not None:
                nas = power_cycle(loop_fs, nas, tmp_path, f"nas-{r + 1}")
            continue
        for w in writers:
            wrong = w.check(m.mnt / w.d.name)
            assert not wrong, f"seed {seed}, round {r}, {w.d.name}: " + "; ".join(wrong)
            if tiered and "DONE" not in w.durable:
                write_file(m.mnt / w.d.name / "DONE", b"", fsync=True)
                w.durable["DONE"] = w.written["DONE"] = b""
        d = m.mnt / f"w{r}"
        d.mkdir()
        fsync_dir(m.mnt)
        w = Writer(d, random.Random(rnd.random()), pool)
        writers.append(w)
        t = threading.Thread(target=w.run)
        t.start()
        # evictions and compactions (whose results are published and whose old objects are
        # deleted from SHARED at once) and waits while the writer writes, before the power goes
        chores = rnd.sample(["evict", "gc", "wait"], rnd.randint(0, 3))
        for chore in chores:
            time.sleep(rnd.uniform(0.1, 0.6))
            if chore == "wait":
                w.waited(m.mnt)
            else:  # may fail if the writer has stopped (it never should, the mount is alive)
                run_cli(chore, "--all" if chore == "evict" else "--compact", m.mnt, timeout=120)
        time.sleep(rnd.uniform(0.2, 1.5))
        for fs in (disk, nas):
            if fs is not None:
                write_canary(fs)
        m.kill()
        t.join(60)
        assert not t.is_alive(), "writer did not stop on a dead mount"
        m.clean_stale()
        disk = power_cycle(loop_fs, disk, tmp_path, f"disk-{r + 1}")
        if nas is not None:
            nas = power_cycle(loop_fs, nas, tmp_path, f"nas-{r + 1}")
    m = mount_on(make_mount, "last", nvme=disk.mnt / "nvme", shared=shared(), args=args)
    for w in writers:
        wrong = w.check(m.mnt / w.d.name)
        assert not wrong, f"seed {seed}, last check, {w.d.name}: " + "; ".join(wrong)
    res = run_cli("wait", m.mnt, timeout=300)
    assert res.rc == 0, res
    if tiered:
        wait_for(lambda: any(cold.rglob("*.seg")), 60, "a checkpoint moved to the cold tier")
    m.unmount()
    res = run_cli("fsck", shared(), "--deep", timeout=300)
    assert res.rc == 0, res
    # Every node reads the same from the stores alone. This failed once in a node-only CI run
    # (a published view that lost its last commit re-applied segments without one GC had
    # deleted; docs/architecture.md sections 8 and 9).
    for w in writers:
        out = tmp_path / "export" / w.d.name
        res = run_cli("export", shared(), w.d.name, out, timeout=300)
        assert res.rc == 0, res
        got = {name: digest((out / name).read_bytes()) for name in os.listdir(out)}
        assert got == {name: digest(data) for name, data in w.durable.items()}, w.d.name


def power_cycle(loop_fs: list[LoopExt4], fs: LoopExt4, tmp_path: Path, name: str) -> LoopExt4:
    """The power loss of one disk, and its next boot: the copy, checked, the old image gone."""
    after = crash(loop_fs, fs, tmp_path, name)
    fs.image.unlink()
    assert_canary_lost(after)
    (after.mnt / "canary").unlink(missing_ok=True)
    return after


# rounds: the tiered variant needs 4 for a checkpoint to reach the cold tier; the long run is
# test_power_loss_long (-m slow)
@pytest.mark.parametrize(("shared_too", "tiered", "rounds"),
                         [(False, False, 2), (True, False, 2), (True, True, 4)],
                         ids=["node", "node-and-store", "node-and-store-tiered"])
def test_power_loss_rounds(loop_fs: list[LoopExt4], make_mount: MakeMount, tmp_path: Path,
                           shared_too: bool, tiered: bool, rounds: int) -> None:
    power_loss_rounds(loop_fs, make_mount, tmp_path, seed=4242, rounds=rounds,
                      shared_too=shared_too, tiered=tiered)


@pytest.mark.slow
@pytest.mark.timeout(6 * 3600)
def test_power_loss_long(loop_fs: list[LoopExt4], make_mount: MakeMount,
                         tmp_path: Path) -> None:
    seed = int(os.environ.get("CKPTFS_POWER_SEED", str(int(time.time()))))
    rounds = int(os.environ.get("CKPTFS_POWER_ROUNDS", "100"))
    shared_too = os.environ.get("CKPTFS_POWER_SHARED", "1") != "0"
    tiered = os.environ.get("CKPTFS_POWER_TIERED", "0") != "0"
    print(f"power loss: seed {seed}, {rounds} rounds, shared store too: {shared_too}, "
          f"tiered: {tiered}")
    power_loss_rounds(loop_fs, make_mount, tmp_path, seed, rounds, shared_too, tiered)
