"""Differential model test: random POSIX operation sequences applied to the mount and to a plain
directory on the host filesystem, compared op by op (return value or errno name) and as a whole
tree after every step and again after unmount + remount (mountpoint-s3 `tests/reftests/`).

Reproduce a failure with the seed in its message:
    CKPTFS_DIFF_SEED=<seed> CKPTFS_DIFF_OPS=<n> pytest -m slow tests/test_posix_diff.py
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import random
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from mounting import MakeMount, Mount

NAMES = ["a", "b", "c", "d", "e", "f"]
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_uint]


def renameat2(src: str, dst: str, flags: int) -> None:
    if _libc.renameat2(-100, os.fsencode(src), -100, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
MAX_SLOTS = 6
Outcome = tuple[str, Any]  # ("ok", value) or ("err", "ENOENT")


# -- one side of the comparison ------------------------------------------------------------


class Side:
    """A root directory plus the fds opened below it, keyed by slot numbers shared by both
    sides (fd numbers themselves differ between sides and are never compared)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fds: dict[int, int] = {}

    def p(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def fd(self, slot: int) -> int:
        return self.fds[slot]

    def close_all(self) -> dict[int, Outcome]:
        out = {}
        for slot, fd in sorted(self.fds.items()):
            out[slot] = attempt(lambda fd=fd: os.close(fd))
        self.fds.clear()
        return out


def errname(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, str(e.errno))


def attempt(fn: Callable[[], Any]) -> Outcome:
    try:
        return ("ok", fn())
    except OSError as e:
        return ("err", errname(e))


def stat_summary(st: os.stat_result) -> tuple[Any, ...]:
    kind = stat.S_IFMT(st.st_mode)
    # Directory sizes are filesystem-specific (ext4 says 4096); everything else must match.
    size = None if kind == stat.S_IFDIR else st.st_size
    return (kind, stat.S_IMODE(st.st_mode), size, st.st_nlink, st.st_uid, st.st_gid)


# -- operations: each is applied to one side and returns a comparable value --------------------


@dataclass
class Op:
    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = []
        for k, v in self.args.items():
            if isinstance(v, bytes):
                v = f"<{len(v)} bytes {hashlib.sha1(v).hexdigest()[:8]}>"
            elif k == "flags":
                v = flag_names(v) if self.name == "open" else {
                    RENAME_EXCHANGE: "RENAME_EXCHANGE", RENAME_NOREPLACE: "RENAME_NOREPLACE"
                }.get(v, v)
            elif k == "mode":
                v = oct(v)
            parts.append(f"{k}={v}")
        return f"{self.name}({', '.join(parts)})"


def flag_names(flags: int) -> str:
    acc = {os.O_RDONLY: "O_RDONLY", os.O_WRONLY: "O_WRONLY", os.O_RDWR: "O_RDWR"}[
        flags & os.O_ACCMODE
    ]
    names = [acc] + [n for n in ("O_CREAT", "O_EXCL", "O_TRUNC", "O_APPEND")
                     if flags & getattr(os, n)]
    return "|".join(names)


def apply(side: Side, op: Op) -> Outcome:
    a = op.args
    name = op.name
    if name == "open":

        def _open() -> str:
            fd = os.open(side.p(a["path"]), a["flags"], a["mode"])
            side.fds[a["slot"]] = fd
            return "fd"

        return attempt(_open)
    if name == "close":

        def _close() -> None:
            fd = side.fds.pop(a["slot"])
            os.close(fd)

        return attempt(_close)
    fd = side.fds.get(a["slot"]) if "slot" in a else None
    p = side.p(a["path"]) if "path" in a else None
    fns: dict[str, Callable[[], Any]] = {
        "write": lambda: os.write(fd, a["data"]),
        "pwrite": lambda: os.pwrite(fd, a["data"], a["off"]),
        "read": lambda: os.read(fd, a["n"]),
        "pread": lambda: os.pread(fd, a["n"], a["off"]),
        "ftruncate": lambda: os.ftruncate(fd, a["size"]),
        "truncate": lambda: os.truncate(p, a["size"]),
        "fsync": lambda: os.fsync(fd),
        "fdatasync": lambda: os.fdatasync(fd),
        "fstat": lambda: stat_summary(os.fstat(fd)),
        "lseek": lambda: os.lseek(fd, a["off"], a["whence"]),
        "rename": lambda: renameat2(side.p(a["src"]), side.p(a["dst"]), a["flags"]),
        "link": lambda: os.link(side.p(a["src"]), side.p(a["dst"]), follow_symlinks=False),
        "unlink": lambda: os.unlink(p),
        "mkdir": lambda: os.mkdir(p, a["mode"]),
        "rmdir": lambda: os.rmdir(p),
        "symlink": lambda: os.symlink(a["target"], p),
        "readlink": lambda: os.readlink(p),
        "chmod": lambda: os.chmod(p, a["mode"]),
        "utime": lambda: os.utime(p, ns=a["ns"], follow_symlinks=a["follow"]),
        "stat": lambda: stat_summary(os.stat(p, follow_symlinks=a["follow"])),
        "listdir": lambda: sorted(os.listdir(p)),
    }
    return attempt(fns[name])


# -- whole-tree state --------------------------------------------------------------------------


def walk(root: str) -> dict[str, os.stat_result]:
    """relpath -> lstat for everything below root (not root itself), without following links."""
    out: dict[str, os.stat_result] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        for name in os.listdir(os.path.join(root, rel)):
            child = f"{rel}/{name}" if rel else name
            st = os.lstat(os.path.join(root, child))
            out[child] = st
            if stat.S_ISDIR(st.st_mode):
                stack.append(child)
    return out


def read_all(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def tree_state(root: str, pinned: set[str]) -> dict[str, tuple[Any, ...]]:
    """Everything compared between the sides: names, types, modes, sizes, nlink, owner, file
    contents (as a digest), symlink targets, and mtime where a test set it explicitly."""
    state = {}
    for rel, st in walk(root).items():
        path = os.path.join(root, rel)
        mtime = st.st_mtime_ns if rel in pinned else None
        summary = stat_summary(st)
        if stat.S_ISREG(st.st_mode):
            digest = hashlib.sha256(read_all(path)).hexdigest()
            state[rel] = ("reg", *summary, digest, mtime)
        elif stat.S_ISLNK(st.st_mode):
            state[rel] = ("lnk", *summary, os.readlink(path), mtime)
        else:
            state[rel] = ("dir", *summary, mtime)
    return state


def first_diff(a: bytes, b: bytes) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first differing byte at {i}: mount {x:#x} host {y:#x}"
    return f"lengths differ: mount {len(a)} host {len(b)}"


def diff_states(
    m: dict[str, tuple[Any, ...]], h: dict[str, tuple[Any, ...]], mroot: str, hroot: str
) -> list[str]:
    lines = []
    for rel in sorted(set(m) | set(h)):
        if rel not in h:
            lines.append(f"only on mount: {rel} {m[rel]}")
        elif rel not in m:
            lines.append(f"only on host:  {rel} {h[rel]}")
        elif m[rel] != h[rel]:
            line = f"{rel}:\n      mount {m[rel]}\n      host  {h[rel]}"
            if m[rel][0] == h[rel][0] == "reg" and m[rel][-2] != h[rel][-2]:
                try:
                    line += "\n      " + first_diff(
                        read_all(os.path.join(mroot, rel)), read_all(os.path.join(hroot, rel))
                    )
                except OSError as e:
                    line += f"\n      re-read failed: {errname(e)}"
            lines.append(line)
    return lines


# -- the random operation generator ------------------------------------------------------------


class Gen:
    """Draws operations from the host side's current state, biased towards collisions (a small
    name pool) and the awkward cases: holes, replace-by-rename, dir into own subdir, unlink of
    open files."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next_slot = 0
        self.slot_kind: dict[int, str] = {}  # "reg" or "dir", from the host fstat at open
        self.slot_path: dict[int, str] = {}

    # sizes and offsets
    def size(self) -> int:
        r = self.rng.random()
        if r < 0.1:
            return 0
        if r < 0.25:
            return self.rng.randint(1, 16)
        if r < 0.75:
            return self.rng.randint(1, 8192)
        if r < 0.97:
            return self.rng.randint(8192, 70_000)
        return self.rng.randint(70_000, 300_000)

    def offset(self) -> int:
        r = self.rng.random()
        if r < 0.25:
            return 0
        if r < 0.6:
            return self.rng.randint(0, 70_000)
        if r < 0.97:
            return max(0, self.rng.randint(0, 16) * 4096 + self.rng.randint(-2, 2))
        return self.rng.randint(300_000, 1_100_000)  # far past EOF: a hole

    def data(self) -> bytes:
        n = self.size()
        if self.rng.random() < 0.3:  # compressible runs as well as noise
            return bytes([self.rng.randrange(256)]) * n
        return self.rng.randbytes(n)

    # paths
    def new_path(self, dirs: list[str]) -> str:
        parent = self.rng.choice([""] + dirs)
        name = self.rng.choice(NAMES)
        return f"{parent}/{name}" if parent else name

    def path(self, entries: dict[str, str], kind: str | None = None) -> str:
        dirs = [p for p, k in entries.items() if k == "dir"]
        files = [p for p, k in entries.items() if k == "reg"]
        r = self.rng.random()
        if r < 0.03 and files:
            return self.rng.choice(files) + "/" + self.rng.choice(NAMES)  # ENOTDIR
        if r < 0.05:
            return "nope/" + self.rng.choice(NAMES)  # ENOENT in the parent
        pool = [p for p, k in entries.items() if kind is None or k == kind]
        if pool and r < 0.7:
            return self.rng.choice(pool)
        return self.new_path(dirs)

    def mode(self, for_dir: bool = False) -> int:
        common = [0o755, 0o700, 0o775] if for_dir else [0o644, 0o600, 0o666, 0o444, 0o755]
        if self.rng.random() < 0.8:
            return self.rng.choice(common)
        return self.rng.randrange(0o1000)

    def ns(self) -> tuple[int, int]:
        def one() -> int:
            sec = self.rng.randint(1_000_000_000, 2_000_000_000)
            frac = self.rng.choice([0, 1, 999_999_999, self.rng.randrange(1_000_000_000)])
            return sec * 1_000_000_000 + frac

        return (one(), one())

    def open_flags(self) -> int:
        acc = self.rng.choice([os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_RDWR])
        flags = acc
        if self.rng.random() < 0.6:
            flags |= os.O_CREAT
            if self.rng.random() < 0.25:
                flags |= os.O_EXCL
        # O_TRUNC with O_RDONLY is unspecified by POSIX; leave it out.
        if acc != os.O_RDONLY and self.rng.random() < 0.2:
            flags |= os.O_TRUNC
        if self.rng.random() < 0.2:
            flags |= os.O_APPEND
        return flags

    def next(self, entries: dict[str, str], open_slots: list[int]) -> Op:
        rng = self.rng
        weights = {
            "open": 14, "close": 5, "write": 8, "pwrite": 8, "read": 5, "pread": 5,
            "ftruncate": 3, "truncate": 3, "fsync": 2, "fdatasync": 1, "fstat": 3, "lseek": 2,
            "rename": 9, "unlink": 5, "mkdir": 5, "rmdir": 3, "symlink": 3, "readlink": 2,
            "link": 3,
            "chmod": 3, "utime": 3, "stat": 4, "listdir": 2,
        }  # fmt: skip
        name = rng.choices(list(weights), list(weights.values()))[0]
        fd_ops = {"close", "write", "pwrite", "read", "pread", "ftruncate", "fsync",
                  "fdatasync", "fstat", "lseek"}
        if name in fd_ops and not open_slots:
            name = "open"
        if name == "open" and len(open_slots) >= MAX_SLOTS:
            name = "close"
        if name in fd_ops:
            slot = rng.choice(open_slots)
            if name == "lseek" and self.slot_kind.get(slot) == "dir":
                name = "fstat"  # directory offsets are filesystem-specific cookies
            if name in ("write",):
                return Op(name, {"slot": slot, "data": self.data()})
            if name == "pwrite":
                return Op(name, {"slot": slot, "data": self.data(), "off": self.offset()})
            if name == "read":
                return Op(name, {"slot": slot, "n": self.size()})
            if name == "pread":
                return Op(name, {"slot": slot, "n": self.size(), "off": self.offset()})
            if name == "ftruncate":
                return Op(name, {"slot": slot, "size": self.offset()})
            if name == "lseek":
                whence = rng.choice([os.SEEK_SET, os.SEEK_CUR, os.SEEK_END])
                off = self.offset() if whence == os.SEEK_SET else rng.randint(-5000, 5000)
                return Op(name, {"slot": slot, "off": off, "whence": whence})
            return Op(name, {"slot": slot})
        if name == "open":
            slot = self.next_slot
            self.next_slot += 1
            return Op("open", {"slot": slot, "path": self.path(entries, "reg"),
                               "flags": self.open_flags(), "mode": self.mode()})
        if name == "truncate":
            return Op(name, {"path": self.path(entries, "reg"), "size": self.offset()})
        if name == "rename":
            return self.rename(entries)
        if name == "link":  # a new name, or an existing one (EEXIST); a directory is EPERM
            dirs = [p for p, k in entries.items() if k == "dir"]
            dst = (rng.choice(list(entries)) if entries and rng.random() < 0.15
                   else self.new_path(dirs))
            return Op(name, {"src": self.path(entries), "dst": dst})
        if name == "unlink":
            live = [self.slot_path[s] for s in open_slots if s in self.slot_path]
            if live and rng.random() < 0.3:
                return Op(name, {"path": rng.choice(live)})  # unlink while open
            return Op(name, {"path": self.path(entries)})
        if name == "mkdir":
            return Op(name, {"path": self.path(entries, "dir"), "mode": self.mode(True)})
        if name == "rmdir":
            return Op(name, {"path": self.path(entries, "dir")})
        if name == "symlink":
            # Relative targets only, never "..": a link must resolve the same way on both
            # sides and never leave the test root.
            target = rng.choice([rng.choice(NAMES), rng.choice(NAMES) + "/" + rng.choice(NAMES),
                                 rng.choice(list(entries) or NAMES)])
            return Op(name, {"target": target, "path": self.path(entries)})
        if name == "readlink":
            return Op(name, {"path": self.path(entries, "lnk")})
        if name == "chmod":
            path = self.path(entries)
            return Op(name, {"path": path, "mode": self.mode(entries.get(path) == "dir")})
        if name == "utime":
            return Op(name, {"path": self.path(entries), "ns": self.ns(),
                             "follow": rng.random() < 0.8})
        if name == "stat":
            return Op(name, {"path": self.path(entries), "follow": rng.random() < 0.5})
        assert name == "listdir"
        return Op(name, {"path": self.path(entries, "dir")})

    def rename(self, entries: dict[str, str]) -> Op:
        rng = self.rng
        src = self.path(entries)
        dirs = [p for p, k in entries.items() if k == "dir"]
        r = rng.random()
        if r < 0.05:
            dst = src  # onto itself: a no-op
        elif r < 0.35 and entries:
            dst = rng.choice(list(entries))  # replace whatever is there
        elif r < 0.45 and entries.get(src) == "dir":
            below = [d for d in dirs if d.startswith(src + "/")]
            dst = rng.choice([src] + below) + "/" + rng.choice(NAMES)  # into itself: EINVAL
        else:
            dst = self.new_path(dirs)
        r = rng.random()  # renameat2(2): swap two entries, or refuse to replace
        flags = RENAME_EXCHANGE if r < 0.15 else RENAME_NOREPLACE if r < 0.25 else 0
        return Op("rename", {"src": src, "dst": dst, "flags": flags})


# -- the driver --------------------------------------------------------------------------------


class Mismatch(AssertionError):
    pass


class Differ:
    """Applies ops to both sides and keeps the host-side bookkeeping of explicitly set mtimes
    (keyed by host inode number, so renames carry them along)."""

    def __init__(self, mount: Mount, host_root: Path, seed: int, log_path: Path) -> None:
        self.mount = mount
        self.mside = Side(mount.mnt / "w")
        self.hside = Side(host_root / "w")
        os.mkdir(self.mside.root)
        os.mkdir(self.hside.root)
        self.seed = seed
        self.gen = Gen(random.Random(seed))
        self.history: list[str] = []
        self.log = open(log_path, "w")  # noqa: SIM115  # closed in close()
        self.pins: dict[int, int] = {}  # host inode -> mtime_ns set by utime
        self.step = 0

    def close(self) -> None:
        self.mside.close_all()
        self.hside.close_all()
        self.log.close()

    # host-side inode helpers for the mtime pins
    def _ino(self, rel: str | None = None, follow: bool = False, slot: int | None = None
             ) -> int | None:
        try:
            if slot is not None:
                return os.fstat(self.hside.fds[slot]).st_ino
            assert rel is not None
            return os.stat(self.hside.p(rel), follow_symlinks=follow).st_ino
        except (OSError, KeyError):
            return None

    def _unpin(self, ino: int | None) -> None:
        if ino is not None:
            self.pins.pop(ino, None)

    def _unpin_parent(self, rel: str) -> None:
        self._unpin(self._ino(os.path.dirname(rel) or ".", follow=True))

    def _track_pins(self, op: Op) -> None:
        """After an op succeeded on the host: which mtimes are no longer the explicit ones."""
        a = op.args
        n = op.name
        if n == "utime":
            st = os.stat(self.hside.p(a["path"]), follow_symlinks=a["follow"])
            self.pins[st.st_ino] = st.st_mtime_ns
        elif n == "open":
            if a["flags"] & (os.O_CREAT | os.O_TRUNC):
                self._unpin(self._ino(slot=a["slot"]))
                # O_CREAT through a dangling symlink creates the link's target: the directory
                # that changed is the resolved path's parent.
                real = os.path.realpath(self.hside.p(a["path"]))
                self._unpin(self._ino(os.path.relpath(os.path.dirname(real), self.hside.root),
                                      follow=True))
        elif n in ("write", "pwrite", "ftruncate"):
            self._unpin(self._ino(slot=a["slot"]))
        elif n == "truncate":
            self._unpin(self._ino(a["path"], follow=True))
        elif n in ("mkdir", "symlink"):
            self._unpin(self._ino(a["path"]))  # a reused inode number is a new file
            self._unpin_parent(a["path"])
        elif n in ("unlink", "rmdir"):
            self._unpin_parent(a["path"])
        elif n == "link":
            self._unpin_parent(a["dst"])
        elif n == "rename":
            self._unpin_parent(a["src"])
            self._unpin_parent(a["dst"])
            # A directory that moved has a new ".."; an exchange moves both entries.
            for moved in (a["dst"], a["src"]) if a["flags"] & RENAME_EXCHANGE else (a["dst"],):
                if os.path.isdir(self.hside.p(moved)) and not os.path.islink(
                    self.hside.p(moved)
                ):
                    self._unpin(self._ino(moved))

    def _pinned_paths(self) -> set[str]:
        root = str(self.hside.root)
        return {rel for rel, st in walk(root).items() if st.st_ino in self.pins}

    def entries(self) -> dict[str, str]:
        kinds = {stat.S_IFDIR: "dir", stat.S_IFREG: "reg", stat.S_IFLNK: "lnk"}
        return {rel: kinds[stat.S_IFMT(st.st_mode)] for rel, st in walk(str(self.hside.root))
                .items()}

    def fail(self, what: str) -> None:
        recent = "\n  ".join(self.history[-30:])
        raise Mismatch(
            f"seed {self.seed}, step {self.step}: {what}\nlast ops (mount => host):\n  {recent}"
        )

    def do(self, op: Op) -> None:
        self.step += 1
        mo = apply(self.mside, op)
        ho = apply(self.hside, op)
        line = f"{self.step}: {op} => {short(mo)}" + ("" if mo == ho else f" | host {short(ho)}")
        self.history.append(line)
        self.log.write(line + "\n")
        if mo != ho:
            self.fail(f"{op}: mount gave {short(mo)}, host gave {short(ho)}")
        if ho[0] == "ok":
            if op.name == "open":
                st = os.fstat(self.hside.fds[op.args["slot"]])
                self.gen.slot_kind[op.args["slot"]] = "dir" if stat.S_ISDIR(st.st_mode) else "reg"
                self.gen.slot_path[op.args["slot"]] = op.args["path"]
            self._track_pins(op)

    def compare_trees(self, when: str) -> None:
        pinned = self._pinned_paths()
        mroot, hroot = str(self.mside.root), str(self.hside.root)
        try:
            m = tree_state(mroot, pinned)
        except OSError as e:
            self.fail(f"{when}: walking the mount failed: {errname(e)} {e}")
        h = tree_state(hroot, pinned)
        if m != h:
            self.fail(f"{when}: trees differ:\n  " + "\n  ".join(diff_states(m, h, mroot, hroot)))

    def close_all(self) -> None:
        mo = self.mside.close_all()
        ho = self.hside.close_all()
        self.history.append(f"{self.step}: close all => {mo}")
        if mo != ho:
            self.fail(f"closing all fds: mount {mo} host {ho}")

    def remount(self) -> None:
        self.close_all()
        self.mount.remount()
        self.history.append(f"{self.step}: -- unmount + remount --")
        self.compare_trees("after remount")

    def run(self, ops: int, remount_every: int) -> None:
        for i in range(1, ops + 1):
            open_slots = sorted(self.hside.fds)
            self.do(self.gen.next(self.entries(), open_slots))
            self.compare_trees(f"after {self.history[-1]}")
            if i % remount_every == 0 or i == ops:
                self.remount()


def short(o: Outcome) -> str:
    kind, v = o
    if kind == "err":
        return v
    if isinstance(v, bytes):
        return f"<{len(v)} bytes {hashlib.sha1(v).hexdigest()[:8]}>"
    return repr(v)


def run_diff(make_mount: MakeMount, tmp_path: Path, seed: int, ops: int, remount_every: int
             ) -> None:
    m = make_mount()
    host = tmp_path / "host"
    host.mkdir()
    d = Differ(m, host, seed, tmp_path / f"ops-{seed}.log")
    try:
        d.run(ops, remount_every)
    finally:
        d.close()


# Several seeds, 3,000 ops in all: the default run (about 10 s here).
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [11, 23, 37, 41])
def test_posix_diff(make_mount: MakeMount, tmp_path: Path, seed: int) -> None:
    run_diff(make_mount, tmp_path, seed, ops=750, remount_every=250)


@pytest.mark.slow
@pytest.mark.timeout(6 * 3600)
def test_posix_diff_long(make_mount: MakeMount, tmp_path: Path) -> None:
    seed = int(os.environ.get("CKPTFS_DIFF_SEED", str(int(time.time()))))
    ops = int(os.environ.get("CKPTFS_DIFF_OPS", "20000"))
    remount_every = int(os.environ.get("CKPTFS_DIFF_REMOUNT_EVERY", "1000"))
    print(f"posix diff: seed {seed}, {ops} ops")
    run_diff(make_mount, tmp_path, seed, ops, remount_every)
