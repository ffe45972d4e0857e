"""`python -m bench`: checkpoint save/restore on ckptfs vs. an emulated NAS vs. the bare NVMe disk.

See bench/README.md for what is measured and how. `--smoke` finishes in seconds (CI);
the default run takes several minutes and ~15 GB of free space under --workdir.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import itertools
import os
import platform
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import ckptfs_target as ck
from bench import report
from bench import workloads as wl
from bench.mounts import drop_caches, fuse_mounts_under, settle_disk, unmount, warm_memory
from bench.nasemu import (
    DEFAULT_BANDWIDTH_MBPS,
    DEFAULT_META_LATENCY_US,
    DEFAULT_META_OPS_PER_SEC,
    NasEmu,
    build,
    stats_delta,
)

GB = 1e9
KiB, MiB = 1 << 10, 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
REPORTED = (
    "bytes_written",
    "log_bytes",
    "bytes_uploaded",
    "segments_uploaded",
    "manifests_published",
    "shared_ops",
    "fsync_calls",
    "device_flushes",
    "seals",
    "segments",
    "last_error",
    "corrupt_reads",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- arguments


PRESETS = {  # (full, smoke)
    "ranks": (8, 8),
    "storm_files": (10_000, 400),
    "storm_min_kib": (256, 16),
    "storm_max_kib": (1024, 64),
    "big_mib": (512, 16),
    "calib_mib": (256, 16),
    "calib_rounds": (3, 1),
    "timeout": (900.0, 120.0),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, finishes in seconds (CI)")
    p.add_argument(
        "--workdir",
        default=tempfile.gettempdir(),
        help="where the NVMe dir, NAS backing dir and mounts go (same disk as /tmp)",
    )
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument(
        "--targets", default="nvme,nas,ckptfs", help="comma list of nvme (c), nas (b), ckptfs (a)"
    )
    p.add_argument("--workloads", default="storm,big", help="comma list of storm, big")
    p.add_argument("--ranks", type=int, help="rank processes (default 8)")
    p.add_argument("--storm-files", type=int, help="shard files in the storm, all ranks (10000)")
    p.add_argument("--storm-min-kib", type=int, help="smallest storm shard in KiB (256)")
    p.add_argument("--storm-max-kib", type=int, help="largest storm shard in KiB (1024)")
    p.add_argument("--big-mib", type=int, help="size of each rank's big shard in MiB (512)")
    p.add_argument("--calib-mib", type=int, help="per-stream MiB of the emulator calibration (256)")
    p.add_argument("--calib-rounds", type=int, help="alternating raw/emulator rounds (3)")
    p.add_argument("--write-chunk-kib", type=int, default=1024, help="bytes per write() call")
    p.add_argument("--no-calibration", action="store_true")
    p.add_argument(
        "--no-drain-test", action="store_true", help="skip the drain-with-backlog measurement"
    )
    p.add_argument("--cold-rounds", type=int, default=2,
                   help="alternating rounds of cold restore vs the SHARED baseline; best of each "
                        "(2; see README: the host may cache the VM's disk)")
    p.add_argument("--no-verify", action="store_true", help="do not checksum restored bytes")
    p.add_argument("--nas-meta-latency-us", type=int, default=DEFAULT_META_LATENCY_US)
    p.add_argument("--nas-meta-ops-per-sec", type=int, default=DEFAULT_META_OPS_PER_SEC)
    p.add_argument("--nas-bandwidth-mbps", type=int, default=DEFAULT_BANDWIDTH_MBPS)
    p.add_argument(
        "--cluster-nodes",
        type=int,
        default=1,
        metavar="N",
        help="the emulated NAS serves N nodes that checkpoint at the same moment: this node "
        "gets 1/N of its metadata ops/s and of its bandwidth (default 1: the whole NAS)",
    )
    p.add_argument(
        "--no-restore", action="store_true", help="skip the hot and cold restores (saves only)"
    )
    p.add_argument(
        "--nas-direct-io",
        choices=("none", "writes", "all"),
        default="writes",
        help="which files the emulator opens with direct_io (default writes: one "
        "copy less on writes, page cache + readahead on reads; see README)",
    )
    p.add_argument(
        "--nas-read-ahead-kb",
        type=int,
        default=1024,
        help="read_ahead_kb of the emulator's mount (NFS rsize=1M; 0 = kernel default)",
    )
    p.add_argument(
        "--ckptfs-args",
        default="",
        help="extra arguments for `ckptfs mount`, e.g. '--upload-streams 4'",
    )
    p.add_argument(
        "--ns-constant",
        type=int,
        default=8,
        help="allowed shared namespace ops beyond one per segment (default 8)",
    )
    p.add_argument("--timeout", type=float, help="bound for any one phase in seconds")
    p.add_argument("--keep", action="store_true", help="keep the work directory (debugging)")
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    for k, (full, smoke) in PRESETS.items():
        if getattr(a, k) is None:
            setattr(a, k, smoke if a.smoke else full)
    a.targets = [t for t in a.targets.split(",") if t]
    a.workloads = [w for w in a.workloads.split(",") if w]
    bad = set(a.targets) - {"nvme", "nas", "ckptfs"} | set(a.workloads) - {"storm", "big"}
    if bad:
        p.error(f"unknown target/workload: {', '.join(sorted(bad))}")
    if a.cluster_nodes < 1:
        p.error("--cluster-nodes must be at least 1")
    if a.storm_min_kib > a.storm_max_kib or a.storm_min_kib < 4:
        p.error("need 4 <= --storm-min-kib <= --storm-max-kib")
    return a


# ---------------------------------------------------------------- helpers


def rate(res: dict) -> dict:
    """seconds/bytes/files of a rank run, plus GB/s and files/s; the per-rank detail dropped."""
    s = res["seconds"]
    out = {
        "seconds": round(s, 4),
        "bytes": res["bytes"],
        "files": res["files"],
        "gbps": res["bytes"] / s / GB if s else None,
        "files_per_s": res["files"] / s if s else None,
    }
    for k in ("file_latency_ms", "mismatch_count", "mismatches", "warmed_memory", "settled_disk"):
        if k in res:
            out[k] = res[k]
    return out


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def files_under(root: Path, skip: tuple[str, ...] = (".nasemu-stats",)) -> list[tuple[str, int]]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            if n in skip:
                continue
            p = os.path.join(dirpath, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if st.st_size and not os.path.islink(p):
                out.append((p, st.st_size))
    return out


class Sampler:
    """Polls the emulator's counters in the background: the drain's timeline on SHARED."""

    def __init__(self, nas: NasEmu, period: float = 0.2):
        self.nas, self.period = nas, period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="nas-sampler")

    def start(self) -> None:
        self._t.start()

    def stop(self) -> None:
        self._stop.set()
        if self._t.is_alive():
            self._t.join(timeout=5)

    def _run(self) -> None:
        while True:
            try:
                s = self.nas.stats()
                self.samples.append((time.monotonic(), s["bytes_written"]))
            except (OSError, ValueError):
                pass
            if self._stop.wait(self.period):
                break
        try:
            s = self.nas.stats()
            self.samples.append((time.monotonic(), s["bytes_written"]))
        except (OSError, ValueError):
            pass


def drain_figures(samples: list[tuple[float, int]], t_save_end: float) -> dict:
    """Drain bandwidth from the SHARED byte counter's timeline.

    Counted only over sampling intervals in which bytes moved (seal-idle gaps are latency, not
    bandwidth). The figure checked against the NAS is the part after the save returned, when the
    drain had a full backlog and no writer competing for the disk; if that part is under a second
    the whole drain is used instead.
    """
    if len(samples) < 2:
        return {"note": "too few samples of the shared store's counters"}
    base, final = samples[0][1], samples[-1][1]
    total = final - base
    if total <= 0:
        return {"note": "nothing was written to SHARED", "bytes": 0}
    act, act_b, after, after_b = 0.0, 0, 0.0, 0
    first = last = None
    for (t0, b0), (t1, b1) in itertools.pairwise(samples):
        if b1 > b0:
            first = t0 if first is None else first
            last = t1
            act += t1 - t0
            act_b += b1 - b0
            if t0 >= t_save_end:
                after += t1 - t0
                after_b += b1 - b0
    out: dict[str, Any] = {
        "bytes": total,
        "window_s": (last - first) if first else None,
        "active_s": round(act, 3),
        "after_save_bytes": after_b,
        "after_save_active_s": round(after, 3),
        "done_after_save_s": (last - t_save_end) if last else None,
    }
    if after >= 1.0:
        out["gbps"] = after_b / after / GB
        out["basis"] = "backlog after the save returned"
    elif act > 0:
        out["gbps"] = act_b / act / GB
        out["basis"] = "whole drain (short backlog after the save)"
    return out


# ---------------------------------------------------------------- the run


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.work = Path(tempfile.mkdtemp(prefix="ckptfs-bench-", dir=a.workdir))
        self.errors: list[str] = []
        self.chunk = a.write_chunk_kib * KiB
        self.verify = not a.no_verify
        # one node's share of a NAS that N nodes' checkpoints hit at once (see README)
        share = a.cluster_nodes
        self.nas_cfg = {
            "meta_latency_us": a.nas_meta_latency_us,
            "meta_ops_per_sec": max(1, round(a.nas_meta_ops_per_sec / share))
            if a.nas_meta_ops_per_sec else 0,
            "bandwidth_mbps": max(1, round(a.nas_bandwidth_mbps / share))
            if a.nas_bandwidth_mbps else 0,
        }
        self.plans = {
            "storm": wl.storm_plan(
                a.ranks, a.storm_files, a.storm_min_kib * KiB, a.storm_max_kib * KiB
            ),
            "big": wl.big_plan(a.ranks, a.big_mib * MiB),
        }
        self.seq = 0

    def fresh(self, name: str) -> Path:
        self.seq += 1
        p = self.work / f"{self.seq:02d}-{name}"
        p.mkdir(parents=True)
        return p

    def nas(self, root: Path, **over: int) -> NasEmu:
        cfg = {**self.nas_cfg, **over}
        return NasEmu(
            root / "nas-backing",
            root / "nas-mnt",
            log_path=root / "nasemu.log",
            direct_io=self.a.nas_direct_io,
            read_ahead_kb=self.a.nas_read_ahead_kb,
            **cfg,
        )

    # -- phases ------------------------------------------------------------------------------

    def prepare(self, plan: list) -> dict:
        """What every save starts from: a clean page cache and no dirty backlog, free pages
        the hypervisor backs whatever ran before (see warm_memory), and an idle disk (see
        settle_disk). ckptfs's targets do it before they mount: done after, the seconds it
        takes left the daemon's first records alone long enough to be sealed as idle, a
        segment and a manifest of their own inside the checkpoint's window."""
        drop_caches()
        return {
            "warmed_memory": warm_memory(wl.plan_bytes(plan) * 9 // 8),
            "settled_disk": settle_disk(self.work),
        }

    def write(
        self, directory: Path, plan: list, metadata: bool = True, prepared: dict | None = None
    ) -> dict:
        prep = prepared if prepared is not None else self.prepare(plan)
        # write_checkpoint makes the checkpoint's directory, right before its shards as
        # training does (callers must not make it earlier: see prepare)
        r = wl.write_checkpoint(
            str(directory), plan, self.chunk, True, metadata, 100, self.a.timeout
        )
        r.update(prep)
        return r

    def read(self, directory: Path, plan: list, cold: bool, metadata: bool = True) -> dict:
        dropped = drop_caches() if cold else None
        settled = settle_disk(self.work) if cold else None
        # a hot read finds only free pages the hypervisor took back (see warm_memory)
        warmed = None if cold else warm_memory(wl.plan_bytes(plan) * 9 // 8)
        r = rate(
            wl.read_checkpoint(
                str(directory), plan, self.chunk, self.verify, metadata, 100, self.a.timeout
            )
        )
        if cold and not dropped:
            r["note"] = "could not drop the page cache: not really cold"
        if warmed is not None:
            r["warmed_memory"] = warmed
        if settled is not None:
            r["settled_disk"] = settled
        if r.get("mismatch_count"):
            self.errors.append(f"restore read wrong bytes in {directory}: {r['mismatches'][:3]}")
        return r

    def calibrate(self) -> dict:
        """Emulator fidelity (no limits vs raw dir) and the NAS's sequential write reference.

        The disk of a shared VM is noisy, so raw and emulator rounds alternate and the best round
        of each is compared (the median is kept too)."""
        a = self.a
        plan8 = wl.big_plan(a.ranks, a.calib_mib * MiB, seed=3)
        plan1 = wl.big_plan(1, a.calib_mib * MiB * max(1, a.ranks // 2), seed=4)
        runs: dict[str, dict] = {}

        def one(name: str, directory: Path, plan: list) -> None:
            directory.mkdir(parents=True, exist_ok=True)
            w = rate(self.write(directory, plan, metadata=False))
            r = self.read(directory, plan, cold=True, metadata=False)
            d = runs.setdefault(name, {"write_rounds": [], "read_rounds": [], "bytes": w["bytes"]})
            d["write_rounds"].append(w["gbps"])
            d["read_rounds"].append(r["gbps"])
            d["write_gbps"], d["read_gbps"] = max(d["write_rounds"]), max(d["read_rounds"])
            for f in directory.iterdir():
                f.unlink()
            log(f"  {name}: write {w['gbps']:.3f} GB/s, cold read {r['gbps']:.3f} GB/s")

        root = self.fresh("calibration")
        raw = f"raw directory ({a.ranks} streams)"
        emu = f"nasemu, no latency, no caps ({a.ranks} streams)"
        with self.nas(root, meta_latency_us=0, meta_ops_per_sec=0, bandwidth_mbps=0) as n:
            for _ in range(a.calib_rounds):
                one(raw, root / "raw", plan8)
                one(emu, n.mountpoint / "c", plan8)
        rmtree(root / "nas-backing")
        bw = a.nas_bandwidth_mbps
        seq1 = f"nasemu, zero latency, {bw} MB/s cap (1 stream)"
        seqn = f"nasemu, zero latency, {bw} MB/s cap ({a.ranks} streams)"
        with self.nas(root, meta_latency_us=0, meta_ops_per_sec=0) as n:
            one(seq1, n.mountpoint / "s1", plan1)
            one(seqn, n.mountpoint / "sn", plan8)
        rmtree(root)
        med = lambda xs: sorted(xs)[len(xs) // 2]
        return {
            "runs": runs,
            "rounds": a.calib_rounds,
            "fidelity_write": runs[emu]["write_gbps"] / runs[raw]["write_gbps"],
            "fidelity_read": runs[emu]["read_gbps"] / runs[raw]["read_gbps"],
            "fidelity_write_median": med(runs[emu]["write_rounds"])
            / med(runs[raw]["write_rounds"]),
            "fidelity_read_median": med(runs[emu]["read_rounds"]) / med(runs[raw]["read_rounds"]),
            # The reference the drain is held to: the best the emulator wrote at zero latency in
            # any round (with or without the cap; the cap only ever lowers it), capped at the cap.
            # Taking the best keeps the disk's noise from lowering the bar for ckptfs.
            "nas_seq_write_gbps": min(
                bw / 1000 if bw else float("inf"),
                max(runs[k]["write_gbps"] for k in (emu, seq1, seqn)),
            ),
        }

    def target_plain(self, workload: str, target: str) -> dict:
        """(c) a directory on the NVMe's filesystem, or (b) the emulated NAS."""
        plan = self.plans[workload]
        root = self.fresh(f"{workload}-{target}")
        out: dict[str, Any] = {}
        with contextlib.ExitStack() as stack:
            if target == "nas":
                n = stack.enter_context(self.nas(root))
                base = n.mountpoint
                pre = n.stats()
            else:
                base, n = root / "nvme", None
            step = base / "step_1"
            out["save"] = rate(self.write(step, plan))
            if n is not None:
                out["shared"] = {"checkpoint": stats_delta(pre, n.stats())}
            if not self.a.no_restore:
                out["restore_hot"] = self.read(step, plan, cold=False)
                out["restore_cold"] = self.read(step, plan, cold=True)
        rmtree(root)
        return out

    def target_ckptfs(self, workload: str) -> dict:
        """(a) ckptfs over the emulated NAS, driven through its CLI."""
        a, plan = self.a, self.plans[workload]
        root = self.fresh(f"{workload}-ckptfs")
        out: dict[str, Any] = {"notes": []}
        notes = out["notes"]
        extra = shlex.split(a.ckptfs_args)
        node_args = ["--node-id", "bench-writer"] if "--node-id" not in extra else []
        with self.nas(root) as nas:
            shared = nas.mountpoint
            prep = self.prepare(plan)
            m = ck.CkptfsMount(
                root / "nvme",
                shared,
                root / "mnt",
                extra + node_args,
                root / "ckptfs.log",
                umount_timeout=a.timeout,
            )
            sampler = Sampler(nas)
            try:
                with m:
                    out["daemon_pid"] = m.pid
                    m.wait_ready()
                    sampler.start()
                    step = m.mountpoint / "step_1"
                    pre = nas.stats()
                    save = self.write(step, plan, prepared=prep)
                    out["save"] = rate(save)
                    log(f"    save {out['save']['seconds']:.2f} s; waiting for durability")
                    out["durable_s"], why = m.wait_durable(step, a.timeout)
                    if why:
                        notes.append(f"durable time n/a: {why}")
                    post = nas.stats() if out["durable_s"] is not None else None
                    st, why = m.status()
                    out["status"] = st
                    if why:
                        notes.append(f"status n/a: {why}")
                    out["segments"], out["segments_note"] = self.segments(st)
                    if isinstance(st, dict):  # what ckptfs says about itself, next to what we count
                        out["ckptfs_reported"] = {k: st[k] for k in REPORTED if k in st}
                    if not a.no_restore:
                        out["restore_hot"] = self.read(step, plan, cold=False)
                        if out["durable_s"] is None:
                            out["restore_hot"]["note"] = "may overlap the drain (no wait command)"
                    log("    unmounting (ckptfs umount drains first)")
                    m.close()  # timed; the with-block's exit is then a no-op
            finally:
                sampler.stop()
            out["daemon"] = m.usage
            out["umount_s"] = m.umount_s
            if not m.umount_clean:
                notes.append(f"umount was not clean ({m.umount_note or 'forced'}): see ckptfs.log")
            if post is None:
                post = nas.stats()
                notes.append(
                    "shared-store ops counted up to the end of `ckptfs umount` (it drains)"
                )
            out["shared"] = {"checkpoint": stats_delta(pre, post)}
            out["drain"] = drain_figures(sampler.samples, save["t1"])
            # replay while the whole log is on NVMe, before the cold restore evicts it (a
            # segment evicted to SHARED replays from its record table: no log read at all)
            drop_caches()
            out["replay"] = ck.replay(root / "nvme", a.timeout)  # cold: after a reboot
            out["replay_warm"] = ck.replay(root / "nvme", a.timeout)  # log cached: after a crash
            evicted = True  # with --no-restore: no cold restore, no fresh node either
            if not a.no_restore:
                try:
                    evicted = self.cold_restore_in_place(
                        root, shared, extra + node_args, plan, out
                    )
                except Exception as e:  # noqa: BLE001 (keep the save's figures)
                    notes.append(f"cold restore n/a: mounting again failed: {e}")
            if not evicted:
                out["restore_cold"] = self.cold_restore_fresh_node(
                    root, shared, extra, "step_1", plan
                )
                out["shared_read_cold"] = self.shared_read(shared)
        rmtree(root)
        return out

    def cold_restore_in_place(
        self, root: Path, shared: Path, args: list[str], plan: list, out: dict
    ) -> bool:
        """Mount the node again, evict the checkpoint's local copy and run the cold rounds;
        False if ckptfs could not evict (the caller then restores on a fresh node). The
        daemon's figures become those of both mounts: peak RSS the higher, CPU the sum."""
        m = ck.CkptfsMount(
            root / "nvme",
            shared,
            root / "mnt",
            args,
            root / "ckptfs.log",
            umount_timeout=self.a.timeout,
        )
        with m:
            m.wait_ready()
            step = m.mountpoint / "step_1"
            evicted, why = m.evict(step, self.a.timeout)
            if evicted:
                out.update(self.cold_rounds(step, plan, shared))
            else:
                out["notes"].append(f"no eviction in place ({why}): cold restore uses a fresh node")
            m.close()
        if not m.umount_clean:
            out["notes"].append(
                f"umount after the cold restore was not clean ({m.umount_note or 'forced'})"
            )
        save, restore = out.get("daemon") or {}, m.usage or {}
        out["daemon_phases"] = {"save": save, "cold_restore": restore}
        peaks = [u["rss_peak_bytes"] for u in (save, restore) if u.get("rss_peak_bytes")]
        out["daemon"] = {
            **save,
            "rss_peak_bytes": max(peaks) if peaks else None,
            "cpu_s": (save.get("cpu_s") or 0) + (restore.get("cpu_s") or 0),
        }
        return evicted

    def shared_read(self, shared: Path) -> dict:
        """The cold-restore baseline: every file under SHARED read by the ranks, page cache
        dropped."""
        drop_caches()
        settled = settle_disk(self.work)
        r = rate(wl.read_paths(files_under(shared), self.a.ranks, self.a.timeout))
        r["settled_disk"] = settled
        r["what"] = "every file under SHARED, read through the emulated NAS"
        return r

    def cold_rounds(self, step: Path, plan: list, shared: Path) -> dict:
        """Cold restore through ckptfs (evicted, page cache dropped) and its baseline, the same
        bytes read straight from SHARED, in alternating rounds; the best of each is reported.

        The guest's page cache is dropped before every read, but a VM's virtual disk may be
        cached by the host, which no guest can drop: whichever of the two reads the bytes first
        pays for the real disk and the other reads the host's cache. Alternating and taking the
        best of each gives both the same chance (round 1's first read is the only one on a
        cold host; it is kept in the JSON)."""
        rounds: dict[str, list[dict]] = {"restore_cold": [], "shared_read_cold": []}
        for i in range(max(1, self.a.cold_rounds)):
            order = ("shared_read_cold", "restore_cold") if i % 2 == 0 else (
                "restore_cold", "shared_read_cold")
            for what in order:
                if what == "restore_cold":
                    r = self.read(step, plan, cold=True)
                    r["how"] = "ckptfs evict, then page cache dropped"
                else:
                    r = self.shared_read(shared)
                r["round"] = i + 1
                rounds[what].append(r)
        out = {}
        for what, rs in rounds.items():
            best = dict(max(rs, key=lambda r: r.get("gbps") or 0))
            best["rounds_gbps"] = [r.get("gbps") for r in rs]
            out[what] = best
        return out

    def drain_test(self) -> dict:
        """Drain capacity with a full backlog: NAS writes held while the big checkpoint is saved,
        then released. Bandwidth = bytes that reached SHARED / time from the release to the last
        byte arriving (the emulator's byte counter, sampled every 0.1 s); the time until
        `ckptfs wait` returned (manifests and CLI start-up included) is reported next to it.

        The NAS runs with latencies at zero (bandwidth cap kept), as in the reference it is
        compared with. The save itself doubles as 'big shards with the drain held back'."""
        a, plan = self.a, self.plans["big"]
        root = self.fresh("drain-ckptfs")
        out: dict[str, Any] = {"notes": []}
        extra = shlex.split(a.ckptfs_args)
        node_args = ["--node-id", "bench-writer"] if "--node-id" not in extra else []
        with self.nas(root, meta_latency_us=0, meta_ops_per_sec=0) as nas:
            prep = self.prepare(plan)
            m = ck.CkptfsMount(
                root / "nvme",
                nas.mountpoint,
                root / "mnt",
                extra + node_args,
                root / "ckptfs.log",
                umount_timeout=a.timeout,
            )
            sampler = Sampler(nas, period=0.1)
            try:
                with m:
                    m.wait_ready()
                    step = m.mountpoint / "step_1"
                    nas.pause_writes()
                    try:
                        out["save_drain_held"] = rate(self.write(step, plan, prepared=prep))
                        pre = nas.stats()
                        sampler.start()
                    finally:
                        nas.resume_writes()
                    t0 = time.monotonic()
                    out["durable_s"], why = m.wait_durable(step, a.timeout)
                    post = nas.stats()
                    if why:
                        out["note"] = f"n/a: {why}"
                    m.close()
                    out["daemon"] = m.usage
            finally:
                sampler.stop()
            out["plain_copy"] = self.plain_copy(root / "nvme" / "segments",
                                                nas.mountpoint / "plain-copy")
            d = stats_delta(pre, post)
            out["bytes"] = d["bytes_written"]
            out["writes_held_s"] = post.get("pause_wait_s")  # summed over the held requests
            moved = [t for (t, b), (_, b0) in itertools.pairwise(sampler.samples[::-1]) if b > b0]
            if out["durable_s"] is not None and d["bytes_written"] > 0 and moved:
                out["seconds"] = moved[0] - t0  # release -> the last sample that saw bytes arrive
                out["gbps"] = d["bytes_written"] / out["seconds"] / GB
                out["gbps_to_durable"] = d["bytes_written"] / out["durable_s"] / GB
            elif out["durable_s"] is not None:
                out["note"] = "nothing reached SHARED after the writes were released"
            out["shared"] = d
        rmtree(root)
        return out

    def plain_copy(self, src: Path, dest: Path) -> dict:
        """The same segment files copied to the NAS by 2 plain streams (sendfile, fsync each),
        page cache dropped first: what one disk allows a drain that must read the log back
        (informational; the target compares the drain with the NAS's write bandwidth)."""
        files = sorted(p for p in src.iterdir() if p.is_file()) if src.is_dir() else []
        if not files:
            return {"note": "no segment files left to copy"}
        dest.mkdir()
        drop_caches()

        def copy(part: list[Path]) -> None:
            for p in part:
                with open(p, "rb") as i, open(dest / p.name, "wb") as o:
                    size, off = os.fstat(i.fileno()).st_size, 0
                    while off < size:
                        off += os.sendfile(o.fileno(), i.fileno(), off, 16 << 20)
                    os.fsync(o.fileno())

        total = sum(p.stat().st_size for p in files)
        t0 = time.monotonic()
        ts = [threading.Thread(target=copy, args=(files[k::2],)) for k in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        secs = time.monotonic() - t0
        rmtree(dest)
        return {"bytes": total, "seconds": secs, "gbps": total / secs / GB,
                "what": "the segment files copied NVMe -> NAS (zero latency) by 2 streams"}

    def cold_restore_fresh_node(
        self, root: Path, shared: Path, extra: list[str], step: str, plan: list
    ) -> dict:
        """Mount SHARED from a new NVMe dir (a node that never had the data) and read it back."""
        args = [x for x in extra if x != "--node-id"] + ["--node-id", "bench-restore"]
        m2 = ck.CkptfsMount(
            root / "nvme2",
            shared,
            root / "mnt2",
            args,
            root / "ckptfs-restore.log",
            umount_timeout=self.a.timeout,
        )
        with m2:
            if ck.cli_has("status"):
                ck.run_cli("status", str(m2.mountpoint), "--refresh", "--json", timeout=60)
            found = ck.find_dir(m2.mountpoint, step)
            if found is None:
                return {"note": f"a fresh node mounting SHARED does not show {step}"}
            r = self.read(found, plan, cold=True)
            rel = found.relative_to(m2.mountpoint)
            r["how"] = f"fresh node (new NVMe dir) mounting SHARED, read {rel}"
            return r

    @staticmethod
    def segments(st: dict | None) -> tuple[int | None, str]:
        if not isinstance(st, dict):
            return None, "no status"
        segs = st.get("segments")
        if isinstance(segs, dict) and all(isinstance(v, int) for v in segs.values()):
            return sum(segs.values()), ""
        if isinstance(segs, int):
            return segs, ""
        return None, "status has no segment count"

    # -- driver ------------------------------------------------------------------------------

    def run(self) -> dict:
        a = self.a
        res: dict[str, Any] = {
            "started": dt.datetime.now().isoformat(timespec="seconds"),
            "mode": "smoke" if a.smoke else "full",
            "machine": f"{platform.node()}, {os.cpu_count()} CPUs, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
            f"kernel {platform.release()}",
            "argv": sys.argv,
            "ckptfs_source": ck.source_fingerprint(),
            "loadavg_start": os.getloadavg(),
            "config": {
                "ranks": a.ranks,
                "nas": self.nas_cfg,
                "cluster_nodes": a.cluster_nodes,
                "write_chunk": self.chunk,
                "ckptfs_args": a.ckptfs_args,
                "workdir": str(self.work),
                "workloads": {
                    "storm": {
                        "files": a.storm_files,
                        "min_bytes": a.storm_min_kib * KiB,
                        "max_bytes": a.storm_max_kib * KiB,
                        "total_bytes": wl.plan_bytes(self.plans["storm"]),
                        "description": f"{a.storm_files} shards of {a.storm_min_kib}-"
                        f"{a.storm_max_kib} KiB from {a.ranks} ranks, fsync each, "
                        f".metadata last ({wl.plan_bytes(self.plans['storm']) / GB:.2f} GB)",
                    },
                    "big": {
                        "per_rank_bytes": a.big_mib * MiB,
                        "description": f"{a.ranks} ranks x one {a.big_mib} MiB shard "
                        f"({a.ranks * a.big_mib * MiB / GB:.2f} GB)",
                    },
                },
            },
            "workloads": {},
            "errors": self.errors,
        }
        t_start = time.monotonic()
        if not a.no_calibration:
            log("calibrating the NAS emulator against the raw directory")
            res["calibration"] = self.guard("calibration", self.calibrate)
        for w in a.workloads:
            res["workloads"][w] = {}
            for t in a.targets:
                log(f"{w}: {report.TARGETS[t]}")
                fn: Callable[[], dict] = (
                    functools.partial(self.target_ckptfs, w)
                    if t == "ckptfs"
                    else functools.partial(self.target_plain, w, t)
                )
                r = self.guard(f"{w}/{t}", fn)
                res["workloads"][w][t] = r
                if r.get("save"):
                    s = r["save"]
                    log(
                        f"  save {s['seconds']:.2f} s ({s['gbps']:.3f} GB/s, "
                        f"{s['files_per_s']:.0f} files/s)"
                        + "".join(
                            f", {k} {r[k]['gbps']:.3f} GB/s"
                            for k in ("restore_hot", "restore_cold")
                            if isinstance(r.get(k), dict) and r[k].get("gbps")
                        )
                    )
        if "ckptfs" in a.targets and "big" in a.workloads and not a.no_drain_test:
            log("drain: ckptfs with the NAS's writes held during the save, then released")
            r = self.guard("drain", self.drain_test)
            res["drain_test"] = r
            if r.get("gbps"):
                log(
                    f"  save with the drain held {r['save_drain_held']['seconds']:.2f} s "
                    f"({r['save_drain_held']['gbps']:.3f} GB/s); drained {r['bytes'] / GB:.2f} GB "
                    f"in {r['seconds']:.2f} s = {r['gbps']:.3f} GB/s"
                )
        res["elapsed_s"] = time.monotonic() - t_start
        res["loadavg_end"] = os.getloadavg()
        return res

    def guard(self, what: str, fn: Callable[[], dict]) -> dict:
        try:
            return fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 (one failed target must not cost the others)
            msg = f"{what}: {type(e).__name__}: {str(e).strip()[:1500]}"
            log("  FAILED " + msg)
            self.errors.append(msg)
            return {"error": msg}

    def cleanup(self) -> None:
        wl.shutdown_pool()
        for mp in fuse_mounts_under(self.work):
            log(f"cleanup: unmounting leftover {mp}")
            unmount(mp, None, timeout=30)
        if self.a.keep:
            log(f"kept {self.work}")
        else:
            rmtree(self.work)


def preflight(a: argparse.Namespace) -> None:
    for need in ("fusermount3", "pkg-config"):
        if not shutil.which(need):
            raise SystemExit(f"bench: {need} not found (install fuse3 and libfuse3-dev)")
    if not os.path.exists("/dev/fuse"):
        raise SystemExit("bench: /dev/fuse is missing")
    need = 2.5 * max(a.storm_files * a.storm_max_kib * KiB, a.ranks * a.big_mib * MiB) + GB
    try:
        os.makedirs(a.workdir, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"bench: cannot make the work directory {a.workdir}: {e.strerror}")
    free = shutil.disk_usage(a.workdir).free
    if free < need:
        raise SystemExit(
            f"bench: {a.workdir} has {free / GB:.1f} GB free, this run needs ~{need / GB:.1f} GB"
        )
    build()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    preflight(a)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    b = Bench(a)
    log(f"work directory {b.work}")
    res: dict | None = None
    try:
        res = b.run()
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
        return 130
    finally:
        b.cleanup()
    checks = report.ratios(res, a.ns_constant)
    res["checks"] = checks
    out_dir = Path(a.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + ("-smoke" if a.smoke else "")
    prefix = out_dir / stamp
    if not a.no_plots:
        res["plots"] = report.plots(res, prefix)
    md = report.markdown(res, checks)
    (prefix.with_suffix(".md")).write_text(md)
    report.save_json(res, prefix.with_suffix(".json"))
    print()
    print(md)
    log(f"results: {prefix}.json, {prefix}.md" + "".join(f", {p}" for p in res.get("plots", [])))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
