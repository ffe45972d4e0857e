"""One mount: lock the NVMe directory, replay, mount, run the services, tear down in order."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import lmdb
import pyfuse3
import trio

from ckptfs import control, knobs, layout, sched
from ckptfs.cache import CacheConfig, LocalCache
from ckptfs.coldtier import ColdTier, Tiered
from ckptfs.drain import PUBLISHED_DIR, Drain
from ckptfs.errors import CliError, FsError
from ckptfs.fs import Operations
from ckptfs.gc import Collector
from ckptfs.index import ROOT_INO, VSEG_BIT, Index, IndexCommitError, SegState, read_applied
from ckptfs.log import PIPELINE, SegmentLog
from ckptfs.namespace import Namespace
from ckptfs.reads import Reader
from ckptfs.recovery import replay
from ckptfs.remote import Refresher, fetch_manifests
from ckptfs.retention import Retention, RetentionConfig
from ckptfs.shared import (
    ANSWER_TIMEOUT,
    PUBLISH_BATCH,
    SharedError,
    SharedStore,
    check_node_id,
    describe_oserror,
    describe_stall,
    open_store,
)

log = logging.getLogger(__name__)
DEFRAG_INTERVAL = 1.0  # seconds between looks for files that small writes fragmented
# once unmounted, the daemon waits this long (s) for a shared store that has stopped
# answering before it exits without it, as a SIGKILL would leave things
EXIT_GRACE = knobs.number("CKPTFS_EXIT_GRACE", 5.0, "seconds")
# seconds between periodic GC passes (tests shorten it; `ckptfs gc` runs one at once)
GC_INTERVAL = knobs.number("CKPTFS_GC_INTERVAL", 15.0, "seconds", 0.01)
# `wait`s that arrive within this long of each other share one seal of the active segment:
# 64 ranks each waiting for its own shard sealed 35 segments (35 objects on SHARED)
WAIT_COALESCE = knobs.number("CKPTFS_WAIT_COALESCE", 0.05, "seconds", 0)
# pyfuse3's request tasks kept waiting for requests when idle. Each owns a 1 MiB request
# buffer, which libfuse allocates at the task's first read and frees when the task ends; with
# pyfuse3's default of 1, every burst of concurrent requests started tasks (and buffers) that
# ended again once idle: a 3,000-file storm from 8 ranks took 8-15% longer, with 10% more
# daemon CPU (bench/README, 2026-12-07 morning)
FUSE_TASKS = knobs.number("CKPTFS_FUSE_TASKS", 16, "tasks", 1)


@dataclass
class MountConfig:
    nvme: str
    shared: str
    mountpoint: str
    node_id: str = ""  # default: the NVME directory's identity, else the hostname
    segment_size: int = 256 << 20
    seal_idle: float = 5.0
    commit_interval: float = 1.0
    allow_other: bool = False
    # the kernel's permission checks (FUSE default_permissions) even where only root can
    # use the mount (Daemon.kernel_permissions)
    default_permissions: bool = False
    fsname: str = "ckptfs"
    upload_streams: int = 2
    publish_batch: int = PUBLISH_BATCH
    upload_limit: float = 0.0  # MB/s, 0 = unlimited
    metrics_port: int = 0
    refresh_interval: float = 5.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    gc_grace: float = 60.0
    nodes_required: int = 0
    dedup: bool = True
    cold: str = ""  # the cold tier's location (directory or s3:// URL), "" = none
    drain_policy: str = "yield"
    # only reads what other nodes publish: the kernel refuses writes (EROFS), and nothing is
    # published, deleted or moved on SHARED (which may be mounted read-only)
    read_only: bool = False


class NvmeLock:
    """An exclusive flock on NVME/ckptfs.lock: one daemon per NVMe directory.

    The file holds the holder's pid and mountpoint. A daemon that was unmounted from outside
    (umount(8), fusermount -u) still holds the lock while it closes its log and index; a mount
    right after it (`umount /ckpt && mount /ckpt`, a service restart) waits for that, up to
    LOCK_WAIT seconds, instead of failing. A holder whose mountpoint is mounted is a live
    daemon: refused at once."""

    LOCK_WAIT = 120.0

    def __init__(self, nvme: str, mountpoint: str = ""):
        self.path = os.path.join(nvme, layout.LOCK_FILE)
        self.mountpoint = mountpoint
        self.fd = -1

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.LOCK_WAIT
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pid, _, where = os.pread(fd, 4096, 0).decode(errors="replace").partition("\n")
                where = where.strip()
                if (where and layout.mount_type(where) != layout.FSTYPE
                        and time.monotonic() < deadline):
                    if not said:  # unmounted and shutting down, or not mounted yet
                        log.warning("waiting for ckptfs daemon pid %s (%s, not mounted) to "
                                    "release %s", pid.strip() or "?", where,
                                    os.path.dirname(self.path))
                        said = True
                    time.sleep(0.05)
                    continue
                os.close(fd)
                at = f", mounted at {where}" if where else ""
                raise CliError(f"{os.path.dirname(self.path)} is in use by another ckptfs "
                               f"daemon (pid {pid.strip() or '?'}{at})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{self.mountpoint}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = -1


_IDENT_TYPES = {"node": str, "first_segment": int, "created_ns": int, "shared": str,
                "cold": str, "adopted": bool, "adopted_seq": int}


def read_identity(nvme: str) -> dict | None:
    """NVME's identity file (see identity()), checked; None if there is none."""
    path = os.path.join(nvme, layout.IDENTITY_FILE)
    try:
        with open(path) as f:
            ident = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CliError(f"{path} is unreadable ({e}); it says which node this directory "
                       f"belongs to") from None
    bad = not isinstance(ident, dict) or any(
        k in ident and (not isinstance(ident[k], t)
                        or (t is int and isinstance(ident[k], bool)))
        for k, t in _IDENT_TYPES.items())
    if bad:
        raise CliError(f"{path} is damaged (not the identity a mount wrote); it says which "
                       f"node this directory belongs to")
    return ident


def identity(nvme: str, node_id: str | None, first_seg: int, shared: str,
             cold: str = "") -> dict:
    """NVME's identity file: which node it belongs to and its first segment id.

    Created on first mount. A later mount with another --node-id is refused: its objects on
    SHARED are named after the node.
    """
    path = os.path.join(nvme, layout.IDENTITY_FILE)
    ident = read_identity(nvme)
    if ident is not None:
        if node_id and ident.get("node") != node_id:
            raise CliError(f"{nvme} belongs to node {ident.get('node')!r}; mount it with "
                           f"--node-id {ident.get('node')} (or use an empty NVME directory)")
        if ident.get("shared") != shared or ident.get("cold", "") != cold:
            ident["shared"] = shared  # remembered for `ckptfs replay`
            ident["cold"] = cold
            layout.publish_bytes(path, (json.dumps(ident) + "\n").encode())
        return ident
    # "adopted" turns true once the node's published namespace was imported into this new
    # directory (see remote.Refresher.import_at_mount)
    ident = {"node": node_id or socket.gethostname(), "first_segment": first_seg,
             "created_ns": time.time_ns(), "shared": shared, "cold": cold, "adopted": False}
    layout.publish_bytes(path, (json.dumps(ident) + "\n").encode())
    return ident


def open_state(nvme: str, node_id: str, segment_size: int, full_replay: bool = False,
               store: SharedStore | None = None, first_seg: int | None = None,
               dir_id: int = 0) -> tuple[Index, SegmentLog, object]:
    """Open the index and the log and bring the index up to the end of the log.

    A full replay starts from the newest index snapshot if there is one (segments before it
    may have been garbage collected) and from the first segment otherwise."""
    from_snapshot = False
    index_dir = os.path.join(nvme, layout.INDEX_DIR)
    if full_replay:
        from ckptfs.gc import restore_snapshot

        from_snapshot = restore_snapshot(nvme, index_dir)
    # a full replay from the first segment reads nothing of the old index: one LMDB cannot
    # read is replaced by an empty one (the old one's pages are reused otherwise: a new file
    # made the replay of a cold log twice as slow)
    from_scratch = full_replay and not from_snapshot
    seglog = SegmentLog(os.path.join(nvme, layout.SEGMENT_DIR), node_id, segment_size, dir_id)
    for attempt in (1, 2):
        index = None
        try:
            index = Index(index_dir)
            started_empty = full_replay or index.applied == (0, 0, 0)
            rep = replay(index, seglog, full=from_scratch, store=store, node=node_id,
                         first_seg=first_seg, dir_id=dir_id)
            break
        except lmdb.Error as e:  # damaged: at the open, or a page met on the way
            if index is not None:
                try:
                    index.close(commit=False)
                except lmdb.Error:
                    pass
            if from_scratch and attempt == 1:
                log.warning("the index %s cannot be read (%s: %s): rebuilding it in a new "
                            "file", index_dir, type(e).__name__, e)
                shutil.rmtree(index_dir, ignore_errors=True)
                continue
            seglog.close()
            raise CliError(f"the index {index_dir} cannot be read ({type(e).__name__}: {e}); "
                           + ("its snapshot is damaged too" if from_snapshot else
                              f"rebuild it from the log with `ckptfs replay {nvme}`")) from None
    rep.from_snapshot = from_snapshot
    if (from_snapshot or started_empty) and store is not None:
        # the segment states are the snapshot's, or replay's own (SEALED): a published
        # segment would be uploaded again, as a second copy under the same name in a new
        # batch directory (of the damaged local copy, if that is why replay was run)
        from ckptfs.recovery import reconcile_states

        reconcile_states(index, seglog, store, node_id, rep)
    return index, seglog, rep


class Daemon:
    def __init__(self, cfg: MountConfig):
        self.cfg = cfg
        self.lock = NvmeLock(cfg.nvme, cfg.mountpoint)
        self.started = time.time()
        self.fsync_count = 0
        self.fsync_seconds = 0.0
        self.metrics = None
        # (directory, log sequence after it) of the last wait's WAITED record (_waited)
        self._last_waited: tuple[int, int] = (0, -1)
        # the seal that waits arriving now will share (_seal_for_wait): set when it is made,
        # with the log sequence before and after it (none if it failed)
        self._wait_seal: tuple[trio.Event, list[int]] | None = None

    def prepare(self) -> None:
        """Everything that can fail with a clear message, before the mount exists."""
        cfg = self.cfg
        # SHARED was probed by `mount` just before (lifecycle.cmd_mount: shared.answers);
        # a store that goes silent after that is _give_up_on_a_silent_store's
        for what, d in (("NVME", cfg.nvme), ("MOUNTPOINT", cfg.mountpoint)):
            if not os.path.isdir(d):
                raise CliError(f"{what} {d} is not a directory" if os.path.exists(d) else
                               f"{what} directory {d} does not exist")
        if not os.path.exists("/dev/fuse"):
            raise CliError("/dev/fuse is missing: load the fuse module or run the container "
                           "with --device /dev/fuse")
        self.lock.acquire()
        try:
            self.store = open_store(cfg.shared, cfg.upload_streams)
            pub = read_applied(os.path.join(cfg.nvme, PUBLISHED_DIR))
            if pub is not None and pub[2] > 0 and isinstance(self.store, SharedStore) \
                    and not self.store.exists():
                raise SharedError(
                    f"{cfg.shared} holds no ckptfs store, but this NVME directory published "
                    f"to one before: is the shared filesystem mounted?")
            if cfg.read_only:
                self.store.verify()  # never creates one
            else:
                self.store.init()
            self.cold = None
            if cfg.cold:
                self.cold = open_store(cfg.cold, cfg.upload_streams)
                self.cold.init()
        except SharedError as e:
            self.lock.release()
            raise CliError(str(e)) from None
        try:  # a new NVME directory, or one that has not imported its node's namespace yet
            with open(os.path.join(cfg.nvme, layout.IDENTITY_FILE), "rb") as f:
                fresh = not json.loads(f.read()).get("adopted", True)
        except FileNotFoundError:
            fresh = True
        except (OSError, ValueError, AttributeError):
            fresh = False  # identity() reports it
        if cfg.read_only:  # before this NVME directory takes the node id
            node = cfg.node_id or (read_identity(cfg.nvme) or {}).get("node") \
                or socket.gethostname()
            try:
                writer = bool(self.store.list_manifests(node))
            except OSError as e:
                self.lock.release()
                raise CliError(f"cannot list manifests on {cfg.shared} "
                               f"({describe_oserror(e)})") from None
            if writer:
                # a refresh never reads its own node's manifests: this mount would not see
                # what that node publishes next
                self.lock.release()
                raise CliError(f"node id {node!r} publishes to {cfg.shared}: a --read-only "
                               f"mount needs a node id of its own (--node-id)")
        # both tiers: an object moved to the cold one keeps its name taken
        tiers = Tiered(self.store, self.cold) if self.cold is not None else self.store
        try:
            objs = tiers.list_objects(cfg.node_id or socket.gethostname())
        except OSError as e:
            if fresh:  # it must number after, and import, what the node published before
                self.lock.release()
                raise CliError(f"cannot list this node's objects on {cfg.shared} "
                               f"({describe_oserror(e)}): a new NVME directory needs them; "
                               f"mount again once SHARED is readable") from None
            objs = []
        ident = identity(cfg.nvme, cfg.node_id, max(objs, default=0) + 1, cfg.shared,
                         cfg.cold)
        cfg.node_id = ident["node"]
        try:
            check_node_id(cfg.node_id)
        except SharedError as e:
            raise CliError(str(e)) from None
        self.index, self.seglog, self.replay_report = open_state(
            cfg.nvme, cfg.node_id, cfg.segment_size,
            store=tiers,
            first_seg=int(ident.get("first_segment", 1)),
            dir_id=int(ident.get("created_ns", 0)))
        rep = self.replay_report
        if rep.records or rep.corruption:
            log.info("replayed %d records from %d segments in %.2fs%s", rep.records,
                     rep.segments_replayed, rep.seconds,
                     f"; {len(rep.corruption)} corrupt records" if rep.corruption else "")
        # a node whose NVMe was lost keeps numbering after what it already published, so its
        # object names and manifest sequence numbers never collide with the old ones
        try:
            objs = tiers.list_objects(cfg.node_id)
            mans = self.store.list_manifests(cfg.node_id)
        except OSError as e:
            log.warning("shared store not readable at mount (%s); continuing on NVMe", e)
            objs, mans = [], []
        if not fresh and not cfg.read_only and mans and max(mans) > self.seglog.seq:
            # every manifest this directory published names a position of its own log: one
            # past its end is another NVME directory's, which took this node over since
            raise CliError(f"node {cfg.node_id!r} has published manifest {max(mans):016x} "
                           f"on {cfg.shared}, past the end of this NVME directory's log "
                           f"({self.seglog.seq:016x}): another NVME directory took the node "
                           f"over since; mount a new, empty NVME directory with this node id "
                           f"(it imports what the node published)")
        # never reuse a segment id: not one published (listing SHARED may have failed), nor
        # one the index still knows whose local file is gone (evicted)
        self.seglog.id_floor = max([*objs, *(s for s, _i in self.index.iter_segments()
                                             if not s & VSEG_BIT)], default=0)
        self.seglog.seq = max(self.seglog.seq, max(mans, default=0))
        self.reader = Reader(self.seglog.path, cfg.node_id, self.store)
        self.reader.bad.update(self.index.iter_bad())  # found by this or an earlier replay
        self.reader.cold = self.cold
        cold_segs = [s for s, i in self.index.iter_segments() if i.state == SegState.COLD]
        if cold_segs and self.cold is None:
            raise CliError(f"{cfg.nvme} has data on the cold tier "
                           f"{ident.get('cold') or '(unknown)'}: mount with --cold "
                           f"{ident.get('cold') or 'URL'}")
        for seg, info in self.index.iter_segments():
            if info.state in (SegState.EVICTED, SegState.COLD):
                self.reader.evicted.add(seg)
            if info.state == SegState.COLD:
                self.reader.cold_segs.add(seg)
        self.ns = Namespace(self.index, self.seglog, self.reader)
        self.ns.dedup = cfg.dedup
        if self.replay_report.segments == 0 and self.index.applied == (0, 0, 0):
            # a new filesystem: its root belongs to the mount point's owner, as a record
            st = os.stat(cfg.mountpoint)
            now = time.time_ns()
            self.ns.setattr(ROOT_INO, mode=0o755, uid=st.st_uid, gid=st.st_gid, atime_ns=now,
                            mtime_ns=now)
        n = self.ns.purge_orphans()
        if n:
            log.info("purged %d orphaned inodes (unlinked while open before a crash)", n)
        try:
            self.drain = Drain(cfg.nvme, cfg.node_id, self.index, self.store, self.seglog.path,
                               self.commit_index, cfg.upload_streams, cfg.upload_limit,
                               cfg.publish_batch)
        except lmdb.Error as e:
            raise CliError(f"the published view {os.path.join(cfg.nvme, PUBLISHED_DIR)} cannot "
                           f"be read ({type(e).__name__}: {e}); rebuild it with `ckptfs replay "
                           f"{cfg.nvme}`") from None
        self.drain.manifest_floor = int(ident.get("adopted_seq", 0))
        self.drain.stalled = self.shared_stall
        self.cache = LocalCache(cfg.nvme, self.index, self.reader, self.seglog.path,
                                lambda: self.seglog.tail if self.seglog.fd >= 0 else 0,
                                cfg.cache)
        self.ns.cache = self.cache

        def sealed(seg: int, size: int, reason: str) -> None:
            self.drain.enqueue(seg)
            self.cache.sealed(size)

        self.seglog.on_seal = sealed
        self.retention = Retention(self.ns, cfg.retention)
        self.cache.protected = lambda: self.retention.protected
        self.gc = Collector(cfg.nvme, cfg.node_id, self.index, self.drain, self.store,
                            self.seglog.path, self.reader.forget, self.commit_index,
                            grace=cfg.gc_grace, interval=GC_INTERVAL)
        self.gc.cold = self.cold
        self.gc.local_freed = self.cache.removed
        self.drain.cold_url = cfg.cold
        self.drain.cold = self.cold
        self.drain.policy = cfg.drain_policy
        self.drain.write_rate = self.seglog.write_rate
        self.drain.under_pressure = lambda: (self.cache.state != "ok"
                                             or self.cache.usage()[0] >= cfg.cache.high)
        self.coldtier = ColdTier(self, self.cold, cfg.cold) if self.cold is not None else None
        self.refresher = Refresher(self.ns, self.store, cfg.node_id,
                                   fresh_nvme=not ident.get("adopted", True),
                                   interval=cfg.refresh_interval,
                                   markers=tuple(cfg.retention.markers))
        self.ns.listed_by = self.refresher.listed_by
        try:
            errors: list[str] = []
            found = fetch_manifests(self.store, {}, errors)
            for msg in errors:
                log.error("ignoring manifest: %s", msg)
            if not ident.get("adopted", True) and cfg.node_id not in found \
                    and self.store.list_manifests(cfg.node_id):
                # adopting without the node's own namespace would lose it: this directory's
                # manifests would replace the unread ones
                raise CliError(f"cannot read node {cfg.node_id}'s manifests on {cfg.shared} "
                               f"({errors[0] if errors else 'none readable'}): a new NVME "
                               f"directory imports them; mount again once SHARED is readable")
            own = found.get(cfg.node_id)
            if not ident.get("adopted", True) and own is not None and own.cold \
                    and (self.cold is None or cfg.cold != own.cold):
                # the imported files would point at objects on a tier this mount cannot
                # read, and its manifests would lose where they are
                raise CliError(f"node {cfg.node_id} has checkpoints on the cold tier "
                               f"{own.cold}: a new NVME directory for it must be mounted "
                               f"with --cold {own.cold}")
            if own is not None:
                # objects of this node that a new NVME directory imported, which no local
                # segment stands for: the next manifests say they are cold as this one does
                self.drain.own_cold = {o: info for o, info in own.objects.items()
                                       if own.tier(o) == "cold"}
            self.refresher.import_at_mount(found)
            if not ident.get("adopted", True):
                self.seglog.sync_now()  # the imports are in the log, durably: now say so
                self.index.commit()
                ident["adopted"] = True
                # segments before the imports (a mount attempt refused after its first
                # record) may publish first: no manifest until the imports are published
                ident["adopted_seq"] = self.seglog.seq
                self.drain.manifest_floor = self.seglog.seq
                layout.publish_bytes(os.path.join(cfg.nvme, layout.IDENTITY_FILE),
                                     (json.dumps(ident) + "\n").encode())
        except OSError as e:
            if not ident.get("adopted", True):
                raise CliError(f"cannot read manifests on {cfg.shared} "
                               f"({describe_oserror(e)}): a new NVME directory imports them; "
                               f"mount again once SHARED is readable") from None
            log.warning("cannot read manifests from the shared store at mount: %s", e)
        # the index never says more than the disk holds: the records appended above (orphans
        # purged, imports, a new root's owner) are flushed before the commit that covers them
        self.seglog.sync_now()
        self.index.commit()
        self.control_path = layout.control_socket_path(cfg.nvme)

    def start_metrics(self) -> None:
        self.metrics = None
        if self.cfg.metrics_port:
            from ckptfs.metrics import Metrics

            try:
                self.metrics = Metrics(self.cfg.metrics_port)
            except OSError as e:
                raise CliError(f"cannot serve metrics on port {self.cfg.metrics_port}: "
                               f"{e.strerror}") from None

    @property
    def kernel_permissions(self) -> bool:
        """Whether the kernel checks permissions (FUSE `default_permissions`). Without
        --allow-other only processes of the mounting user can use a FUSE mount at all; when
        that user is root, every check passes but the execute bits of files, so the kernel's
        checks are left out (`access()` asks Operations.access, which keeps those bits):
        with them, each create in a directory cost a GETATTR of the directory first, inside
        the directory's lock, because the create before it had made the kernel drop its
        attributes (bench/README.md, 2026-12-07, 14:00). --default-permissions keeps them
        (root processes without CAP_DAC_OVERRIDE would otherwise pass checks they fail)."""
        cfg = self.cfg
        return cfg.default_permissions or cfg.allow_other or os.geteuid() != 0

    def mount(self) -> None:
        cfg = self.cfg
        self.ops = ops = Operations(self.ns, cfg.nvme, {
            b"user.ckptfs.control": self.control_path.encode(),
            b"user.ckptfs.pid": str(os.getpid()).encode(),
        }, on_fsync=self._fsync_seen, read_only=cfg.read_only)
        opts = set(pyfuse3.default_options) - {"default_permissions"}
        # FUSE splits options at commas; a backslash escapes one (and itself)
        fsname = cfg.fsname.replace("\\", "\\\\").replace(",", "\\,")
        opts |= {f"fsname={fsname}", "subtype=ckptfs", "noatime"}
        if self.kernel_permissions:
            opts.add("default_permissions")
        if cfg.allow_other:
            opts.add("allow_other")
        if cfg.read_only:
            opts.add("ro")  # the kernel answers EROFS to writes: they never reach us
        try:
            pyfuse3.init(ops, cfg.mountpoint, opts)
        except RuntimeError as e:
            raise CliError(f"cannot mount {cfg.mountpoint}: {e}") from None

    def _fsync_seen(self, seconds: float) -> None:
        self.fsync_count += 1
        self.fsync_seconds += seconds
        if self.metrics is not None:
            self.metrics.fsync_latency.observe(seconds)

    async def run(self) -> None:
        if PIPELINE:  # data records go to the disk while the trio thread serves others
            self.seglog.token = trio.lowlevel.current_trio_token()
        try:
            await self._run()
        finally:
            self.seglog.token = None  # what is still queued, shutdown() joins the plain way

    async def _run(self) -> None:
        async with trio.open_nursery() as nursery:
            if not self.cfg.read_only:
                # a read-only mount's log holds only its imports of other nodes' files:
                # nothing to publish, evict, retain, move, collect or defragment
                await nursery.start(self.drain.run)
                nursery.start_soon(self.cache.run, self.drain.kick)
                nursery.start_soon(self._retention_loop)
                if self.coldtier is not None:
                    nursery.start_soon(self.coldtier.run)
                nursery.start_soon(self._gc_loop)
                nursery.start_soon(self._defrag_loop)
            nursery.start_soon(self.refresher.run)
            if self.metrics is not None:
                nursery.start_soon(self.metrics.run, self.status)
            nursery.start_soon(self._commit_loop)
            nursery.start_soon(self._idle_seal_loop)
            nursery.start_soon(self._signals)
            await nursery.start(control.serve, self)
            nursery.start_soon(self._tune_read_ahead)
            await pyfuse3.main(min_tasks=FUSE_TASKS, max_tasks=max(99, FUSE_TASKS))
            pending = self.drain.pending() if not self.cfg.read_only else []
            if pending:
                log.info("unmounted with %d segments (%d bytes) not yet on SHARED: they stay "
                         "in NVME and are published after the next mount", len(pending),
                         sum(size for _s, size in pending))
            self.drain.stop_uploads()
            threading.Thread(target=self._exit_without_the_store, name="ckptfs-exit-watch",
                             daemon=True).start()
            nursery.cancel_scope.cancel()

    async def _tune_read_ahead(self) -> None:
        # the kernel sets the mount's read-ahead from the INIT reply, so wait for INIT to pass
        for _ in range(100):
            await trio.sleep(0.05)
            if tune_read_ahead(self.cfg.mountpoint):
                return

    async def _retention_loop(self) -> None:
        while True:
            await trio.sleep(2.0)
            try:
                self.retention_pass()
            except Exception:
                log.exception("retention pass failed; will try again")

    def retention_pass(self) -> dict:
        res = self.retention.run_once()
        for parent, name in res["entries"]:
            try:  # (its directory, its name): "run/step_1" is no name in the root
                pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)  # unseen: fine
            except Exception as e:
                log.debug("invalidating %r in directory %d: %s", name, parent, e)
        if self.coldtier is not None and res["to_cold"]:
            self.coldtier.want(res["to_cold"])
        for seg in sorted(res["evictable"]):
            info = self.index.get_segment(seg)
            if info is not None and info.state == SegState.PUBLISHED:
                self.cache.evict(seg, info.size)
        return res

    async def _gc_loop(self) -> None:
        while True:
            # every second while writers wait for local space: the unpublished data of files
            # deleted meanwhile (DROPPED segments) leaves NVMe only through GC
            slept = 0.0
            while slept < self.gc.interval and self.cache.state != "full":
                await trio.sleep(1.0)
                slept += 1.0
            if self.cache.state == "full":
                await trio.sleep(1.0)
                # segments the index has all dead wait for the view to apply the records that
                # killed them; those may sit in the active segment, which a writer that keeps
                # retrying never lets go idle
                if self.seglog.has_records() and self.gc.dead_beyond_view():
                    try:
                        self.ns.seal("space")
                    except OSError as e:
                        log.error("sealing the active segment to free space failed: %s", e)
            try:
                await self.gc.collect()
                if self.cache.state != "full":  # compaction writes: not into a full disk
                    await self.gc.compact(self.ns)
            except Exception:
                log.exception("garbage collection failed; will try again")

    async def _defrag_loop(self) -> None:
        """Merge the small extents of files grown by small writes (namespace.py, SMALL_WRITE),
        one record at a time so requests keep being served in between."""
        while True:
            await trio.sleep(DEFRAG_INTERVAL)
            while self.ns.defrag_due:
                ino = self.ns.defrag_due.pop()
                small = self.ns.small_writes.pop(ino, None)
                pos: int | None = small[1] if small else 0  # nothing before it changed
                try:
                    while pos is not None:
                        pos = self.ns.defrag_step(ino, pos)
                        await trio.sleep(0)
                except (FsError, OSError) as e:  # a damaged record (EIO), a full disk
                    log.warning("defragmenting inode %d stopped: %s", ino, e)
                except Exception:  # never let housekeeping take the mount down
                    log.exception("defragmenting inode %d failed", ino)

    def shared_stall(self) -> tuple[float, str]:
        """(seconds without an answer, what waits) of the shared store, or of the cold
        tier's if that one has gone silent longer (shared.Watch)."""
        stores = [getattr(self, "store", None), getattr(self, "cold", None)]
        return max((st.watch.stalled() for st in stores if st is not None),
                   default=(0.0, ""))

    def silent_for(self, seconds: float, until: threading.Event | None = None
                   ) -> tuple[float, str]:
        """Block (a thread of its own) until the shared store has been silent for `seconds`
        while calls wait (shared_stall); that stall. (0.0, "") if `until` is set first."""
        until = until or threading.Event()
        while not until.wait(0.5):
            stall = self.shared_stall()
            if stall[0] >= seconds:
                return stall
        return 0.0, ""

    def _exit_without_the_store(self) -> None:
        """Unmounted, with calls into a shared store that does not answer: they would hold
        the exit forever (a thread blocked in an NFS or FUSE request cannot be interrupted
        from Python). Exit without them once the store has been silent for EXIT_GRACE.
        Nothing is lost: what the calls were for is redone after the next mount, as after
        a SIGKILL, and the log the next mount replays is flushed first."""
        stall, what = self.silent_for(EXIT_GRACE)
        log.error("unmounted, but %s: exiting without it; what it owes is published after "
                  "the next mount", describe_stall(stall, what))
        try:
            if self.seglog.fd >= 0:
                os.fdatasync(self.seglog.fd)
            os.fsync(self.seglog.dir_fd)
        except OSError as e:
            log.error("flushing the log before exiting: %s", e)
        logging.shutdown()
        os._exit(0)

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for _ in sigs:
                log.info("signal received: unmounting")
                pyfuse3.terminate()
                return

    async def commit_index(self) -> None:
        """Commit the index, never ahead of the log (write-ahead rule).

        The bulk of the log flush happens off the trio thread; the few records appended while
        it ran are flushed synchronously together with the LMDB commit, so the committed
        `applied` position never points past durable log bytes.
        """
        if not self.index.dirty or self.seglog.broken is not None:
            return  # broken: said once by the log; the next mount replays what it holds
        await self.seglog.sync()
        self.seglog.sync_now()
        try:
            self.index.commit()
        except IndexCommitError as e:
            self._recover_index(str(e))

    def _recover_index(self, why: str) -> None:
        """The index fell back to its last commit: bring it forward from the log again,
        including the segment states that only the index kept."""
        from ckptfs.recovery import catch_up

        n = catch_up(self.index, self.seglog)
        for seg in self.reader.evicted:
            info = self.index.get_segment(seg)
            if info is not None and info.state == SegState.PUBLISHED:
                self.index.set_segment(seg, SegState.EVICTED)
        if self.seglog.fd >= 0 and self.index.get_segment(self.seglog.seg_id) is None:
            self.index.set_segment(self.seglog.seg_id, SegState.ACTIVE)
        for seg, _size in self.drain.pending():
            self.drain.enqueue(seg)
        self.drain.kick()
        log.error("%s: %d records re-applied; is NVMe full? (%s free)", why, n,
                  shutil.disk_usage(self.cfg.nvme).free)

    async def _commit_loop(self) -> None:
        while True:
            await trio.sleep(self.cfg.commit_interval)
            try:
                t0 = time.monotonic()
                await self.commit_index()
                dt = time.monotonic() - t0
                if dt > 0.5:
                    log.warning("index commit took %.2fs", dt)
            except OSError as e:
                log.error("index commit failed: %s", e)

    async def _idle_seal_loop(self) -> None:
        while True:
            await trio.sleep(min(1.0, self.cfg.seal_idle / 2))
            sl = self.seglog
            if sl.has_records() and time.monotonic() - sl.last_append >= self.cfg.seal_idle:
                try:
                    self.ns.seal("idle")
                except OSError as e:
                    log.error("sealing idle segment failed: %s", e)

    # --- control requests -----------------------------------------------------------------

    async def handle_request(self, req: dict, progress) -> dict:
        op = req.get("op")
        if op == "status":
            if req.get("refresh"):
                await self.refresher.refresh()
            return {"status": self.status()}
        if op == "sync":
            self.ns.seal("wait")
            await self.commit_index()
            return {}
        if op in ("wait", "drain"):
            timeout = req.get("timeout")
            rel = req.get("path", "")
            ino = self._resolve(rel)
            if self.cfg.read_only:  # everything here came from SHARED: published already
                return {"published_seq": self.drain.manifest_seq}
            vouch = op == "wait" and await self._waited(ino)
            target = self.seglog.seq
            before, after = await self._seal_for_wait()
            if vouch and before == target:  # nothing logged between our WAITED and the seal
                self._last_waited = (ino, after)
            if target > self.drain.manifest_seq:
                await self.drain.wait_seq(target, timeout, progress)
            damaged = await self._damaged_under(ino, rel) if op == "wait" else []
            if damaged:
                more = f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
                raise ValueError(f"{rel or '/'}: published, but damaged on this node: "
                                 f"{', '.join(damaged[:3])}{more} (reads of the damaged "
                                 f"ranges give EIO; `ckptfs status` says where)")
            return {"published_seq": self.drain.manifest_seq}
        if op == "evict":  # operators and tests: drop every published local copy now
            return {"evicted": self.cache.evict_all() if req.get("all") else
                    self.cache.evict_to(self.cfg.cache.low)}
        if op == "gc" and self.cfg.read_only:
            return {"deleted_checkpoints": [], "segments_freed": 0, "compacted_bytes": 0,
                    "skipped": "a --read-only mount deletes nothing"}
        if op == "gc":  # operators and tests: run retention and GC now, without grace
            res = self.retention_pass()
            moved = await self.gc.compact(self.ns) if req.get("compact") else 0
            n = await self.gc.collect(force=True)
            return {"deleted_checkpoints": res["deleted"], "segments_freed": n,
                    "compacted_bytes": moved, "skipped": self.gc.skipped}
        if op == "refresh":
            n = await self.refresher.refresh()
            return {"changes": n}
        raise ValueError(f"unknown control request {op!r}")

    async def _seal_for_wait(self) -> tuple[int, int]:
        """Seal the active segment for a `wait` (if it holds records), together with the
        waits that arrive within WAIT_COALESCE: one object on SHARED for all of them instead
        of one each. Returns the log sequence just before and just after that seal; every
        record logged before this call is in a sealed segment when it returns."""
        shared = self._wait_seal
        if shared is not None:
            done, seqs = shared
            await done.wait()
            if len(seqs) == 2:
                return seqs[0], seqs[1]
            # that seal failed (the wait that made it got the error): try once more, alone
        else:
            done, seqs = self._wait_seal = (trio.Event(), [])
            try:
                await trio.sleep(WAIT_COALESCE)
            finally:
                self._wait_seal = None  # a wait arriving from now on needs a seal of its own
                try:
                    before = self.seglog.seq
                    if self.seglog.has_records():
                        self.ns.seal("wait")
                    seqs += [before, self.seglog.seq]
                finally:
                    done.set()
            return seqs[0], seqs[1]
        before = self.seglog.seq
        if self.seglog.has_records():
            self.ns.seal("wait")
        return before, self.seglog.seq

    async def _waited(self, ino: int) -> bool:
        """A WAITED record for a directory whose `wait` begins: once published, it tells other
        nodes' `wait --all-nodes` that all this node wrote under it before now is published
        too (docs/operations.md, "Multi-node checkpoints"). Not again when nothing was logged
        since the last one for it. False if none was written."""
        node = self.index.get_inode(ino)
        is_dir = node.is_dir if node is not None else ino == ROOT_INO  # the root may have no row
        if not is_dir or self._last_waited == (ino, self.seglog.seq):
            return False
        await self.ns.log.unqueue()  # a record the log does not queue (fs.unqueued)
        try:
            self.ns.waited(ino)
        except (FsError, OSError) as e:  # a full disk: the wait itself goes on
            log.warning("cannot log the wait for inode %d (other nodes' wait --all-nodes "
                        "will not count this node for it yet): %s", ino, e)
            return False
        return True

    async def _damaged_under(self, ino: int, rel: str) -> list[str]:
        """Paths of the files at or under `ino` with an extent in a record known to be
        damaged (by replay, or by a read since), unless SHARED has a good copy of it (one
        published before the damage): reads of it give EIO on every node."""
        bad = self.reader.bad
        if not bad:
            return []
        found: list[tuple[str, list]] = []
        stack = [(ino, rel)]
        while stack:
            cur, path = stack.pop()
            node = self.index.get_inode(cur)
            if node is None and cur != ROOT_INO:
                continue
            if node is None or node.is_dir:  # the root may have no row
                for _cookie, name, child in self.index.readdir(cur, 0):
                    stack.append((child, f"{path}/{os.fsdecode(name)}" if path
                                  else os.fsdecode(name)))
            else:
                hit = [e for e in self.index.iter_extents(cur) if (e.seg, e.rec_pos) in bad]
                if hit:
                    found.append((path, hit))
        out = []
        for path, hit in found:
            for e in hit:
                # SHARED may have a good copy (published before the damage); a hung NAS:
                # the wait's caller gives up (its timeout), the thread is left to it
                if await trio.to_thread.run_sync(self.reader.shared_copy, e,
                                                 abandon_on_cancel=True) is None:
                    out.append(path)
                    break
        return sorted(out)

    def _resolve(self, rel: str) -> int:
        """The inode at a path relative to the mount root (ENOENT -> ValueError)."""
        ino = ROOT_INO
        for comp in rel.split("/"):
            if comp in ("", "."):
                continue
            child = self.index.lookup(ino, os.fsencode(comp))
            if child is None:
                raise ValueError(f"{rel}: no such file or directory in the mount")
            ino = child
        return ino

    def status(self) -> dict:
        from ckptfs.index import SegState

        by_state: dict[str, int] = {}
        local_bytes = 0
        live = data = 0
        for _seg, info in self.index.iter_segments():
            name = SegState.NAMES.get(info.state, str(info.state))
            by_state[name] = by_state.get(name, 0) + 1
            if info.state not in (SegState.EVICTED, SegState.COLD):
                local_bytes += info.size
            live += info.live
            data += info.data
        du = shutil.disk_usage(self.cfg.nvme)
        st = self.seglog.stats
        stall = self.shared_stall()
        return {
            "mountpoint": self.cfg.mountpoint, "nvme": self.cfg.nvme, "shared": self.cfg.shared,
            "node_id": self.cfg.node_id, "pid": os.getpid(), "read_only": self.cfg.read_only,
            "nodes_required": self.cfg.nodes_required,
            "retain": list(self.cfg.retention.retain), "markers": list(self.cfg.retention.markers),
            "uptime_s": round(time.time() - self.started, 1),
            # what applications wrote (bytes the incremental drain found already written
            # count too: they were written, just not stored twice)
            "bytes_written": st.data_bytes + self.ns.dedup_bytes,
            "log_bytes": st.bytes_appended,
            "records": st.records, "fsync_calls": self.fsync_count,
            "fsync_mean_ms": round(1000 * self.fsync_seconds / self.fsync_count, 3)
            if self.fsync_count else None, "log_syncs": st.sync_calls,
            "device_flushes": st.flushes, "log_unsynced_bytes": self.seglog.unsynced_bytes(),
            "log_direct_records": st.direct_records, "log_zero_copy_records": st.zero_copy_records,
            "log_pad_bytes": st.pad_bytes, "log_records_ahead": st.records_ahead,
            "log_records_in_slots": st.records_in_slots,
            "log_records_riding": st.records_riding,
            "log_records_buffered": st.records_buffered,
            "log_queued": len(self.seglog.queued),
            "seals": st.seals, "segments": by_state, "active_segment_bytes": self.seglog.tail
            if self.seglog.fd >= 0 else 0,
            "local_bytes_used": local_bytes, "local_bytes_free": du.free,
            "ops": dict(self.ns.ops.counts),
            "bytes_uploaded": self.drain.stats.bytes_uploaded,
            "bytes_pending_upload": 0 if self.cfg.read_only else (
                sum(size for _s, size in self.drain.pending())
                + (self.seglog.tail if self.seglog.fd >= 0 else 0)
                - sum(self.drain.in_flight.values())),
            "upload_rate_bytes_s": round(self.drain.stats.rate()),
            "segments_uploaded": self.drain.stats.segments_uploaded,
            "batches_published": self.drain.stats.batches,
            "manifests_published": self.drain.stats.manifests_published,
            "published_seq": self.drain.manifest_seq, "log_seq": self.seglog.seq,
            "shared_ops": dict(self.store.ops),
            "shared_bytes_read": self.store.bytes_read,
            # a flush of the log failed: no more writes until the next mount (log.py)
            "log_error": (f"{self.seglog.broken.strerror or self.seglog.broken}"
                          if self.seglog.broken is not None else None),
            "last_error": self.drain.stats.last_error,
            "failing_for_s": (round(time.monotonic() - self.drain.stats.failing_since, 1)
                              if self.drain.stats.failing_since is not None else 0.0),
            # a hung store fails nothing: how long it has not answered while calls wait
            "shared_stalled_s": round(stall[0], 1), "shared_stalled_on": stall[1],
            "remote": self.refresher.status(),
            "cache": self.cache.status(),
            "live_data_bytes": live, "segment_data_bytes": data,
            "segments_dropped": self.drain.stats.segments_dropped,
            "drain_ready": self.drain.ready,
            "drain_yielding": self.drain.yielding,
            "drain_yield_seconds": round(self.drain.yield_seconds, 1),
            "dedup": {"enabled": self.ns.dedup, "hits": self.ns.dedup_hits,
                      "bytes_not_written": self.ns.dedup_bytes},
            "defrag": {"records": self.ns.defrag_records, "extents_merged": self.ns.defrag_extents},
            "gc": self.gc.status(),
            "retention": self.retention.status(),
            "cold": self.coldtier.status() if self.coldtier is not None else None,
            "corrupt_reads": self.reader.corrupt_reads,
            "damaged_records": len(self.reader.bad),
            "healed_reads": self.reader.healed_reads,
            "read_ahead": dict(self.reader.ahead),
            "read_misses": self.reader.nowait_misses,
            "replay": self.replay_report.as_dict(),
            # what the daemon keeps in memory per inode: each should follow the kernel's
            # working set, not every file ever written (operations.md, "Memory")
            "inodes_tracked": {"kernel": len(self.ns.lookups), "open": len(self.ns.opens),
                               "written_direct": len(self.ops.written_direct),
                               "open_direct": len(self.ops.uncached_writers)},
            "priority": sched.status(),
        }

    def shutdown(self) -> None:
        try:
            self.ns.seal("shutdown")
        except OSError as e:
            log.error("sealing at shutdown failed: %s", e)
        self.seglog.close()
        try:
            # never commit what a log that failed to flush may not hold: the next mount
            # replays what reached the disk
            self.index.close(commit=self.seglog.broken is None)
        except IndexCommitError as e:  # the next mount replays the log past the last commit
            log.error("%s", e)
            self.index.close(commit=False)
        self.drain.close()
        self.reader.close()
        self.store.close()
        if self.metrics is not None:
            self.metrics.close()
        try:
            os.unlink(self.control_path)
        except FileNotFoundError:
            pass
        self.lock.release()


def tune_read_ahead(mountpoint: str, kb: int = 1024) -> bool:
    """Ask for 1 MiB read requests instead of 128 KiB (about 2x cold reads: PERF-NOTES).

    True once the setting reads back (or cannot be changed at all)."""
    dev = layout.mount_device(mountpoint)  # from mountinfo: a stat here could deadlock
    if dev is None:
        return False
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path) as f:
            if int(f.read()) >= kb:
                return True
        with open(path, "w") as f:
            f.write(str(kb))
        return False
    except (OSError, ValueError) as e:
        log.debug("could not raise read_ahead_kb: %s", e)
        return getattr(e, "errno", None) in (errno.EACCES, errno.EROFS, errno.EPERM)


def _give_up_on_a_silent_store(d: Daemon, ready_fd: int, settled: threading.Event) -> None:
    """Until the mount is up: if the shared store stops answering (ANSWER_TIMEOUT) while
    the daemon prepares (it reads this node's objects and the other nodes' manifests), say
    so in one line and exit, as `mount` does when the store is silent from the start. Nothing
    is mounted yet, and what was written to NVME is as after a SIGKILL."""
    if ANSWER_TIMEOUT <= 0:
        return
    stall, what = d.silent_for(ANSWER_TIMEOUT, until=settled)  # set once mounted, or failed
    if not stall:
        return
    msg = f"SHARED {d.cfg.shared}: {describe_stall(stall, what)}; nothing was mounted"
    log.error("%s", msg)
    logging.shutdown()
    if ready_fd >= 0:
        os.write(ready_fd, f"error {msg}\n".encode())
    else:
        print(f"ckptfs: error: {msg}", file=sys.stderr, flush=True)
    os._exit(1)


def _entries_if_new(nvme: str) -> set[str] | None:
    """What NVME holds before its first mount (None once it has an identity file)."""
    if os.path.lexists(os.path.join(nvme, layout.IDENTITY_FILE)):
        return None
    try:
        return set(os.listdir(nvme))
    except OSError:
        return None


def _undo_first_mount(nvme: str, before: set[str] | None) -> None:
    """A first mount of an NVME directory that failed before the mount came up (a metrics
    port in use, FUSE refusing the mount) leaves the directory as it found it, but for its
    log: no application write reached it, and its identity file would bind the --node-id of
    a command the user is about to correct (`NVME belongs to node 'typo'`)."""
    if before is None:
        return
    try:
        made = set(os.listdir(nvme)) - before
    except OSError:
        return
    for name in sorted(made):
        if name.endswith(".log"):
            continue
        path = os.path.join(nvme, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError as e:
            log.warning("could not remove %s after the failed mount: %s", path, e)


# glibc malloc arenas the daemon's threads share. glibc gives each thread that allocates an
# arena of its own (up to 8 per CPU) and keeps what is freed in it: a node that reads another
# node's checkpoints through 8 worker threads grew to 160 MiB of private memory in 16
# checkpoints (bench.steady --reader) with glibc's default, 86 MiB with 2, at the same speed
# (the storm and bench.readpath within their noise). 0 keeps glibc's default; so does a
# MALLOC_ARENA_MAX in the environment, which wins.
MALLOC_ARENAS = knobs.number("CKPTFS_MALLOC_ARENAS", 2, "arenas")
M_ARENA_MAX = -8  # malloc.h


def limit_malloc_arenas() -> bool:
    """Cap glibc's malloc arenas (before the daemon starts its threads). False where it does
    not apply: turned off, set in the environment, or not glibc."""
    if not MALLOC_ARENAS or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, int(MALLOC_ARENAS)))
    except (OSError, AttributeError):
        return False


def run_foreground(cfg: MountConfig, ready_fd: int = -1) -> int:
    if limit_malloc_arenas():
        log.debug("malloc arenas capped at %d", MALLOC_ARENAS)
    sched.raise_priority()  # before any thread starts: they inherit it
    d = Daemon(cfg)
    settled = threading.Event()
    threading.Thread(target=_give_up_on_a_silent_store, args=(d, ready_fd, settled),
                     name="ckptfs-startup-watch", daemon=True).start()
    new_nvme = _entries_if_new(cfg.nvme)
    try:
        d.prepare()
    except BaseException:
        settled.set()
        _undo_first_mount(cfg.nvme, new_nvme)
        raise
    try:
        d.start_metrics()
        d.mount()
    except BaseException:
        settled.set()
        d.shutdown()
        _undo_first_mount(cfg.nvme, new_nvme)
        raise
    settled.set()
    log.info("mounted %s (nvme %s, shared %s, node %s)", cfg.mountpoint, cfg.nvme, cfg.shared,
             cfg.node_id)
    if ready_fd >= 0:
        os.write(ready_fd, b"ok\n")
        os.close(ready_fd)
    try:
        trio.run(d.run)
    except BaseException:
        log.exception("the daemon stopped on an unexpected error")
        raise
    finally:
        pyfuse3.close(unmount=True)
        d.shutdown()
        log.info("unmounted %s", cfg.mountpoint)
    return 0
