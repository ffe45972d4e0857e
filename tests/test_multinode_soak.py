"""Randomized multi-node soak: nodes write, rewrite, rename and delete while daemons are killed
and NVMe directories lost, and every node, a fresh node and `ckptfs export` must converge on
the namespace a model of the documented rules predicts.

The rules the model follows (docs/architecture.md, section 5):

- each node writes its checkpoint directories (HF-style `tmp-checkpoint-K` renamed to
  `checkpoint-K`, DCP-style `step_K` with `.metadata` last); another node sees them once they
  are published. Any node may delete an old checkpoint: what it has of it goes on every node
  (tombstones), what it has not seen yet stays;
- several nodes write shards into one `tmp-checkpoint-K` and one of them renames it: the
  files it moved are its own under the new name, and gone from the old one everywhere
  (docs/operations.md, "Deletes and renames reach every node");
- `common/` holds files every node rewrites. Whole files only: the version with the greatest
  (mtime, node id) wins everywhere. Each rewrite sets an mtime above every earlier one, and
  above every natural mtime (while the file is open, so a refresh cannot swap the file between
  the write and the utime), so the last rewrite in the test's order wins;
- an operation that returned survives a SIGKILL of its daemon; a node whose NVMe is lost after
  `wait` gets back everything it published.

- a `last-NODE` symlink moved to each node's newest checkpoint follows on every node, and
  goes everywhere when its node removes it; a directory its node deletes goes everywhere.

Files, symlinks and directories are compared: the directories must be exactly those that
hold something of the model (nothing the soak empties stays behind anywhere).

    CKPTFS_SOAK_SEED=S CKPTFS_SOAK_ROUNDS=N [CKPTFS_SOAK_ARGS="--gc-grace 3"] \
        pytest -m slow tests/test_multinode_soak.py
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
from mounting import MakeMount, Mount
from test_shared_support import cli, read_tree, start_node, status, tree_diff

NODES = ("n0", "n1", "n2")
COMMON = 4  # common/c0 .. common/c3
# Above every natural mtime of this run: a rewrite in progress on one node, published half
# done with the mtime its writes gave it, must lose against every finished version, as with
# real clocks, where a later write has a later mtime. (Below them, it won: the conflict rule
# then took it over a newer finished version elsewhere, which its own utime then undercut.)
MTIME_BASE = time.time_ns() + 86_400 * 10**9


class Soak:
    def __init__(self, make_mount: MakeMount, tmp_path: Path, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.seed = seed
        self.make_mount = make_mount
        self.tmp = tmp_path
        self.nodes: dict[str, Mount] = {}
        self.args = os.environ.get("CKPTFS_SOAK_ARGS", "").split()
        first = start_node(make_mount, "m-n0", "n0", extra=self.args)
        self.shared = first.shared
        self.nodes["n0"] = first
        for node in NODES[1:]:
            self.nodes[node] = start_node(make_mount, f"m-{node}", node, shared=self.shared,
                                          extra=self.args)
        self.model: dict[str, bytes] = {}
        self.links: dict[str, str] = {}  # symlink -> target
        self.owner: dict[str, str] = {}  # path -> the node that publishes it
        self.ckpts: dict[str, list[str]] = {n: [] for n in NODES}  # own checkpoint dirs
        self.contents: list[bytes] = [b""]  # earlier contents, for deduplicated rewrites
        self.clock = 0  # mtime counter for common/
        self.serial = 0
        self.log: list[str] = []

    # -- contents -------------------------------------------------------------------------

    def data(self) -> bytes:
        r = self.rnd.random()
        if r < 0.2:
            return self.rnd.choice(self.contents)  # identical bytes again: dedup, REF records
        size = self.rnd.choice((0, 1, 100, 4096, 70_000, 300_000, 1_200_000, 5_000_000))
        size = self.rnd.randint(size // 2, size) if size > 1 else size
        b = self.rnd.randbytes(size)
        if self.rnd.random() < 0.3:
            b = b[: size // 2] * 2  # compressible, repeating halves
        self.contents.append(b)
        return b

    # -- operations -----------------------------------------------------------------------

    def write_file(self, m: Mount, rel: str, data: bytes, fsync: bool) -> None:
        p = m.mnt / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    def op_checkpoint(self, node: str) -> None:
        m = self.nodes[node]
        self.serial += 1
        hf = self.rnd.random() < 0.5
        final = f"checkpoint-{node}-{self.serial}" if hf else f"step_{node}_{self.serial}"
        where = f"tmp-checkpoint-{node}-{self.serial}" if hf else final
        files = {f"__{r}_0.distcp": self.data() for r in range(self.rnd.randint(1, 5))}
        for name, b in files.items():
            self.write_file(m, f"{where}/{name}", b, self.rnd.random() < 0.5)
        self.write_file(m, f"{where}/.metadata", b"meta %d" % self.serial, True)
        files[".metadata"] = b"meta %d" % self.serial
        if hf:
            os.rename(m.mnt / where, m.mnt / final)
        for name, b in files.items():
            self.put(f"{final}/{name}", b, node)
        self.ckpts[node].append(final)
        self.log.append(f"{node}: checkpoint {final} ({len(files)} files, hf={hf})")

    def op_delete(self, node: str) -> None:
        """rm -r of an old checkpoint, this node's or another's: what this node has of it
        goes everywhere (what it has not seen yet stays)."""
        writer = self.rnd.choice(NODES)
        if len(self.ckpts[writer]) < 2:
            return self.op_checkpoint(node)
        d = self.ckpts[writer].pop(self.rnd.randrange(len(self.ckpts[writer]) - 1))
        p = self.nodes[node].mnt / d
        had = read_tree(p) if p.is_dir() else {}
        shutil.rmtree(p, ignore_errors=not p.is_dir())
        for name, b in had.items():
            if self.model.get(f"{d}/{name}") == b:
                self.drop(f"{d}/{name}")
        left = [r for r in self.model if r.startswith(d + "/")]
        if left:
            self.ckpts[writer].insert(0, d)  # to delete again later
        self.log.append(f"{node}: rm -r {writer}'s {d} ({len(had)} files here"
                        + (f", {len(left)} not seen yet)" if left else ")"))

    def op_common(self, node: str) -> None:
        """Rewrite, patch or truncate a common file, then give it the newest mtime."""
        m = self.nodes[node]
        rel = f"common/c{self.rnd.randrange(COMMON)}"
        p = m.mnt / rel
        p.parent.mkdir(exist_ok=True)
        how = self.rnd.choice(("rewrite", "patch", "truncate"))
        self.clock += 1
        t = MTIME_BASE + self.clock * 1000
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # what this node holds now, perhaps an older version than another node's
            cur = os.pread(fd, 1 << 30, 0)
            if how == "rewrite":
                new = self.data()
                os.ftruncate(fd, 0)
                os.pwrite(fd, new, 0)
            elif how == "patch":
                off = self.rnd.randint(0, len(cur))
                patch = self.rnd.randbytes(self.rnd.randint(1, 100_000))
                os.pwrite(fd, patch, off)
                new = cur[:off] + patch + cur[off + len(patch):]
            else:
                n = self.rnd.randint(0, len(cur) + 10_000)
                os.ftruncate(fd, n)
                new = cur[:n] + b"\0" * max(0, n - len(cur))
            if self.rnd.random() < 0.5:
                os.fsync(fd)
            os.utime(fd, ns=(t, t))
        finally:
            os.close(fd)
        assert p.read_bytes() == new, f"{node}: {rel} does not read back after {how}"
        self.put(rel, new, node)
        self.log.append(f"{node}: {how} {rel} -> {len(new)} bytes, mtime #{self.clock}")

    def op_shared_checkpoint(self, node: str) -> None:
        """Every node writes its shard into one tmp-checkpoint directory; `node` renames it
        after a refresh brought it the others' shards (or some of them: a node that did not
        publish yet stays behind)."""
        self.serial += 1
        tmp, final = f"tmp-checkpoint-x{self.serial}", f"checkpoint-x{self.serial}"
        for n, m in self.nodes.items():
            b = self.data()
            self.write_file(m, f"{tmp}/shard-{n}", b, self.rnd.random() < 0.5)
            self.put(f"{tmp}/shard-{n}", b, n)
            if n != node and self.rnd.random() < 0.8:
                cli("wait", m.mnt / tmp, "--timeout", "120", timeout=180)
        m = self.nodes[node]
        status(m, refresh=True)
        self.write_file(m, f"{tmp}/trainer_state.json", b"{}", True)
        self.put(f"{tmp}/trainer_state.json", b"{}", node)
        os.rename(m.mnt / tmp, m.mnt / final)
        moved = read_tree(m.mnt / final)  # what it had: a refresh may have brought more
        for name, b in moved.items():
            want = self.model[f"{tmp}/{name}"]
            if b == want:
                self.drop(f"{tmp}/{name}")  # from every node: a tombstone for others' files
            else:  # a shard published half written, before its node waited: that node's
                # whole version is another one, which the tombstone does not take
                assert self.owner[f"{tmp}/{name}"] != node and want.startswith(b), (
                    f"{node}: {tmp}/{name} moved other bytes")
            self.put(f"{final}/{name}", b, node)
        self.ckpts[node].append(final)
        self.log.append(f"{node}: renamed {tmp} with {sorted(moved)} to {final}")

    def put(self, rel: str, data: bytes, node: str) -> None:
        self.model[rel] = data
        self.owner[rel] = node

    def drop(self, rel: str) -> None:
        del self.model[rel]
        del self.owner[rel]

    def op_link(self, node: str) -> None:
        """Point `last-NODE` at the node's newest checkpoint (a new symlink renamed over the
        old one), or remove it."""
        m = self.nodes[node]
        rel = f"last-{node}"
        if self.ckpts[node] and self.rnd.random() < 0.8:
            target = self.ckpts[node][-1]
            os.symlink(target, m.mnt / f"{rel}.tmp")
            os.replace(m.mnt / f"{rel}.tmp", m.mnt / rel)
            self.links[rel] = target
            self.log.append(f"{node}: {rel} -> {target}")
        elif rel in self.links:
            os.unlink(m.mnt / rel)
            del self.links[rel]
            self.log.append(f"{node}: rm {rel}")

    def op_kill(self, node: str) -> None:
        """SIGKILL the daemon, while a file is being written on it or not. Every write that
        returned must be there after the remount, and nothing else but the rest of the file's
        bytes in order."""
        m = self.nodes[node]
        writing = self.rnd.random() < 0.6
        if writing:
            self.serial += 1
            rel = f"inflight-{node}-{self.serial}/shard"
            data = self.rnd.randbytes(self.rnd.randint(1, 40) << 20)
            (m.mnt / rel).parent.mkdir()
            done = [0]
            opened = threading.Event()

            def write() -> None:
                try:
                    fd = os.open(m.mnt / rel, os.O_WRONLY | os.O_CREAT, 0o644)
                    opened.set()
                    try:
                        while done[0] < len(data):
                            done[0] += os.write(fd, data[done[0]:done[0] + (1 << 20)])
                    finally:
                        os.close(fd)
                except OSError:
                    pass  # the daemon died under it

            th = threading.Thread(target=write)
            th.start()
            time.sleep(self.rnd.random() * 0.3)
        m.kill()
        if writing:
            th.join()
        m.clean_stale()
        m.start()
        if writing:
            try:
                got = (m.mnt / rel).read_bytes()
            except FileNotFoundError:
                got = None
            assert got is not None or not opened.is_set(), f"{node}: {rel} lost after SIGKILL"
            if got is None:
                os.rmdir((m.mnt / rel).parent)
            if got is not None:
                assert len(got) >= done[0], (f"{node}: {rel} has {len(got)} bytes after "
                                             f"SIGKILL, {done[0]} were written")
                assert got == data[:len(got)], f"{node}: {rel} holds other bytes after SIGKILL"
                self.put(rel, got, node)
        self.log.append(f"{node}: SIGKILL and remount"
                        + (f" while writing {rel} ({done[0]} bytes returned)" if writing else ""))

    def op_lose_nvme(self, node: str) -> None:
        m = self.nodes[node]
        cli("wait", m.mnt, "--timeout", "120", timeout=180)
        m.unmount()
        shutil.rmtree(m.nvme)
        m.nvme.mkdir()
        m.start()
        self.log.append(f"{node}: waited, lost its NVMe, remounted empty")

    # operation -> weight
    OPS = {"checkpoint": 25, "link": 5, "shared_checkpoint": 7, "delete": 13, "common": 38,
           "kill": 8, "lose_nvme": 4}

    def step(self) -> None:
        node = self.rnd.choice(NODES)
        op = self.rnd.choices(list(self.OPS), weights=list(self.OPS.values()))[0]
        getattr(self, f"op_{op}")(node)

    # -- convergence ----------------------------------------------------------------------

    def converge(self, round_: int) -> None:
        """Every node publishes a new manifest (files of another node renamed away come back
        only with their owner's next manifest), everything is published, every node refreshed
        twice (a node's refresh may publish again), then every node and `export` hold the
        model."""
        for n, m in self.nodes.items():
            self.write_file(m, f"sync-{n}", b"round %d" % round_, False)
            self.put(f"sync-{n}", b"round %d" % round_, n)
        for _ in range(2):
            for m in self.nodes.values():
                cli("wait", m.mnt, "--timeout", "120", timeout=180)
            for m in self.nodes.values():
                status(m, refresh=True)
        for node, m in self.nodes.items():
            self.check(m.mnt, f"node {node}")
        dest = self.tmp / f"export-{len(self.log)}"
        cli("export", self.shared, "", dest)
        self.check(dest, "ckptfs export of SHARED")
        shutil.rmtree(dest)

    def check(self, root: Path, what: str) -> None:
        files: dict[str, bytes] = {}
        dirs: set[str] = set()
        links: dict[str, str] = {}
        for d, subdirs, names in os.walk(root):
            rel = os.path.relpath(d, root)
            for n in subdirs + names:
                p = os.path.join(d, n)
                r = n if rel == "." else f"{rel}/{n}"
                if os.path.islink(p):
                    links[r] = os.readlink(p)
                elif os.path.isdir(p):
                    dirs.add(r)
                else:
                    files[r] = Path(p).read_bytes()
        want_dirs = {"/".join(p.split("/")[:i]) for p in [*self.model, *self.links]
                     for i in range(1, p.count("/") + 1)}
        diff = tree_diff(self.model, files)
        if links != self.links:
            diff.append(f"symlinks {links} instead of {self.links}")
        if dirs != want_dirs:
            diff.append(f"directories not expected: {sorted(dirs - want_dirs)}, missing: "
                        f"{sorted(want_dirs - dirs)}")
        assert not diff, (f"{what} differs from the model (CKPTFS_SOAK_SEED={self.seed}):\n  "
                          + "\n  ".join(diff)
                          + "\nlast operations:\n  " + "\n  ".join(self.log[-15:]))

    def fresh_node(self) -> None:
        m = start_node(self.make_mount, f"fresh-{len(self.log)}", "n9", shared=self.shared)
        try:
            self.check(m.mnt, "a fresh node on SHARED")
        finally:
            m.unmount()


def soak(make_mount: MakeMount, tmp_path: Path, seed: int, rounds: int, ops: int) -> None:
    s = Soak(make_mount, tmp_path, seed)
    for r in range(rounds):
        for _ in range(ops):
            s.step()
        s.converge(r)
    s.fresh_node()
    print("\n".join(s.log))
    assert cli("fsck", s.shared, "--deep", check=False).returncode == 0


def test_multinode_soak(make_mount: MakeMount, tmp_path: Path) -> None:
    soak(make_mount, tmp_path, seed=1, rounds=2, ops=10)


@pytest.mark.slow
def test_multinode_soak_long(make_mount: MakeMount, tmp_path: Path) -> None:
    seed = int(os.environ.get("CKPTFS_SOAK_SEED", str(int(time.time()))))
    soak(make_mount, tmp_path, seed, int(os.environ.get("CKPTFS_SOAK_ROUNDS", "12")), ops=15)
