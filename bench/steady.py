"""Steady state: many checkpoints through one long-lived mount, with retention on.

    python -m bench.steady [--checkpoints 24] [--files 1000] [--keep-local 2] [--keep-shared 3]

A training job does not save once: it saves every N steps for days, through one daemon, and
retention (`--keep-local`, `--keep-shared`) and GC delete what is old. This runs that loop on
one machine and reports what must stay flat: the save time, the time until `ckptfs wait`
returns, the daemon's memory, and the bytes on NVMe and on SHARED.

Each round writes one checkpoint `run/step_K` (8 ranks, DCP-style shards, fsync each, rank 0
writes `.metadata` last) twice, alternating which goes first: through ckptfs (then `ckptfs
wait`) and straight into a plain directory on the same disk, which keeps only its newest
`--keep-local` checkpoints (the baseline, in the same run, so the disk's noise hits both).
Every checkpoint has fresh bytes (a seed per round), so nothing deduplicates.

After each round the daemon's VmHWM / RssAnon / RssFile (/proc/PID/status) and `du` of NVME
and SHARED are sampled. The report compares the first and the second half of the run:
median save ratio (ckptfs / plain), median wait, memory growth per checkpoint in the second
half, and the largest NVME and SHARED footprint in checkpoints' worth. SHARED lags its
retention by GC's grace and interval (`--gc-grace`, `CKPTFS_GC_INTERVAL`), so its bound is
in rounds, not in kept checkpoints.

With `--reader`, a second node (`--read-only`, its own empty NVME directory, the same SHARED)
reads every checkpoint right after `ckptfs wait` returned, as an evaluation node would, and
checks every byte: its read time and its memory are reported too (a node that imports
another's namespace for days must not grow either). Results:
bench/results/steady-<timestamp>.json and .md.
Needs /dev/fuse; everything runs under --workdir and is unmounted and removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.ckptfs_target import CkptfsMount, proc_usage, run_cli, source_fingerprint
from bench.mounts import drop_caches
from bench.workloads import plan_bytes, read_checkpoint, shutdown_pool, storm_plan, write_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 1 << 20


def du(path: Path) -> int:
    """Bytes allocated under path (st_blocks, as du counts), 0 if it vanished meanwhile."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def memory(pid: int | None) -> dict:
    """The daemon's VmHWM / VmRSS / RssAnon / RssFile in bytes (empty once it is gone)."""
    u = proc_usage(pid) if pid else None
    if u is None:
        return {}
    got = {"VmHWM": u["rss_peak_bytes"], "VmRSS": u["rss_bytes"],
           "RssAnon": u["rss_anon_bytes"], "RssFile": u["rss_file_bytes"]}
    return {k: v for k, v in got.items() if v is not None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.steady", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoints", type=int, default=24, help="rounds (default 24)")
    p.add_argument("--files", type=int, default=1000, help="shards per checkpoint (default 1000)")
    p.add_argument("--min-kib", type=int, default=256, help="smallest shard (default 256 KiB)")
    p.add_argument("--max-kib", type=int, default=1024, help="largest shard (default 1024 KiB)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--keep-local", type=int, default=2)
    p.add_argument("--keep-shared", type=int, default=3)
    p.add_argument("--gc-grace", type=float, default=5.0,
                   help="ckptfs --gc-grace, seconds (default 5; the daemon's default is 60)")
    p.add_argument("--reader", action="store_true",
                   help="a second, read-only node reads and checks every checkpoint")
    p.add_argument("--workdir", help="parent of the work directory (default: the system's tmp)")
    p.add_argument("--results-dir", default=str(RESULTS))
    p.add_argument("--smoke", action="store_true",
                   help="toy sizes: 6 rounds of 24 files of 16-64 KiB (seconds; for CI)")
    a = p.parse_args(argv)
    if a.smoke:
        a.checkpoints, a.files, a.min_kib, a.max_kib = 6, 24, 16, 64
    if a.checkpoints < 2 or a.files < 1 or a.ranks < 1 or a.min_kib < 4 or a.max_kib < a.min_kib:
        p.error("need --checkpoints >= 2, --files >= 1, --ranks >= 1 and 4 <= --min-kib <= "
                "--max-kib")
    return a


def run(a: argparse.Namespace, work: Path) -> dict:
    nvme, shared, mnt, plain = work / "nvme", work / "shared", work / "mnt", work / "plain"
    for d in (shared, plain):
        d.mkdir(parents=True)
    args = ["--keep-local", str(a.keep_local), "--keep-shared", str(a.keep_shared),
            "--gc-grace", str(a.gc_grace)]
    rounds = []
    with contextlib.ExitStack() as stack:
        m = stack.enter_context(CkptfsMount(nvme, shared, mnt, args, work / "ckptfs.log"))
        r = None
        if a.reader:
            r = stack.enter_context(CkptfsMount(
                work / "reader-nvme", shared, work / "reader-mnt",
                ["--read-only", "--node-id", "steady-reader"], work / "reader.log"))
        for k in range(1, a.checkpoints + 1):
            plan = storm_plan(a.ranks, a.files, a.min_kib << 10, a.max_kib << 10, seed=k)
            size = plan_bytes(plan)
            row: dict = {"checkpoint": k, "bytes": size}
            # alternate which target goes first: the second one finds the disk busier
            order = ("ckptfs", "plain") if k % 2 else ("plain", "ckptfs")
            for target in order:
                root = mnt if target == "ckptfs" else plain
                step = root / "run" / f"step_{k}"
                drop_caches()
                res = write_checkpoint(str(step), plan, MiB, fsync=True, metadata=True,
                                       buf_seed=1000 * k, timeout=1800)
                row[f"{target}_save_s"] = res["seconds"]
                if target == "ckptfs":
                    row["wait_s"], why = m.wait_durable(step, timeout=1800)
                    if row["wait_s"] is None:
                        raise RuntimeError(f"checkpoint {k}: {why}")
                else:
                    old = plain / "run" / f"step_{k - a.keep_local}"
                    shutil.rmtree(old, ignore_errors=True)
            if r is not None:
                row.update(read_on_reader(r, k, plan))
            row.update(memory(m.pid))
            row["nvme_bytes"] = du(nvme)
            row["shared_bytes"] = du(shared)
            row["kept"] = len(os.listdir(mnt / "run"))
            rounds.append(row)
            print(f"[{k:>3}/{a.checkpoints}] save ckptfs {row['ckptfs_save_s']:6.2f} s, plain "
                  f"{row['plain_save_s']:6.2f} s, wait {row['wait_s']:5.2f} s; daemon VmHWM "
                  f"{row.get('VmHWM', 0) / MiB:5.0f} MiB, RssAnon "
                  f"{row.get('RssAnon', 0) / MiB:4.0f} MiB; "
                  f"NVME {row['nvme_bytes'] / MiB:6.0f} MiB, SHARED "
                  f"{row['shared_bytes'] / MiB:6.0f} MiB; {row['kept']} checkpoints kept"
                  + (f"; reader: read {row['reader_read_s']:.2f} s, VmHWM "
                     f"{row['reader_VmHWM'] / MiB:.0f} MiB, RssAnon "
                     f"{row['reader_RssAnon'] / MiB:.0f} MiB, inodes tracked "
                     f"{row['reader_inodes_tracked']}" if r is not None else ""),
                  flush=True)
        status, _ = m.status()
        return {"rounds": rounds, "status": status, "daemon": m.usage,
                "reader_daemon": r.usage if r is not None else None}


def read_on_reader(r: CkptfsMount, k: int, plan: list) -> dict:
    """The reader node refreshes (other nodes' manifests), then its ranks read checkpoint k
    and check every byte against what the writers wrote."""
    t0 = time.monotonic()
    res = run_cli("status", str(r.mountpoint), "--refresh", "--json", timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"reader refresh: {res.stderr.strip()[-300:]}")
    step = r.mountpoint / "run" / f"step_{k}"
    if not step.is_dir():
        raise RuntimeError(f"the reader does not see {step.name} after a refresh")
    refreshed = time.monotonic() - t0
    tracked = json.loads(res.stdout).get("inodes_tracked", {})
    drop_caches()
    got = read_checkpoint(str(step), plan, MiB, verify=True, metadata=True, buf_seed=1000 * k,
                          timeout=1800)
    if got["mismatch_count"]:
        raise RuntimeError(f"the reader read wrong bytes in {step.name}: {got['mismatches']}")
    mem = memory(r.pid)
    return {"reader_refresh_s": refreshed, "reader_read_s": got["seconds"],
            "reader_VmHWM": mem.get("VmHWM", 0), "reader_RssAnon": mem.get("RssAnon", 0),
            "reader_inodes_tracked": tracked}


def summarize(a: argparse.Namespace, rounds: list[dict]) -> dict:
    half = len(rounds) // 2
    first, second = rounds[:half], rounds[half:]
    ratio = lambda rs: statistics.median(r["ckptfs_save_s"] / r["plain_save_s"] for r in rs)
    ckpt = statistics.median(r["bytes"] for r in rounds)
    span = max(1, len(second) - 1)
    grow = lambda key: (second[-1].get(key, 0) - second[0].get(key, 0)) / span
    return {
        "checkpoint_bytes": ckpt,
        "save_ratio_first_half": ratio(first),
        "save_ratio_second_half": ratio(second),
        "wait_s_first_half": statistics.median(r["wait_s"] for r in first),
        "wait_s_second_half": statistics.median(r["wait_s"] for r in second),
        "vmhwm_bytes": max(r.get("VmHWM", 0) for r in rounds),
        "vmhwm_growth_bytes_per_checkpoint_second_half": grow("VmHWM"),
        "rssanon_growth_bytes_per_checkpoint_second_half": grow("RssAnon"),
        "nvme_max_checkpoints": max(r["nvme_bytes"] for r in rounds) / ckpt,
        "shared_max_checkpoints": max(r["shared_bytes"] for r in rounds) / ckpt,
        "shared_last_half_max_checkpoints": max(r["shared_bytes"] for r in second) / ckpt,
        **({
            "reader_read_gbps_first_half": statistics.median(
                r["bytes"] / r["reader_read_s"] / 1e9 for r in first),
            "reader_read_gbps_second_half": statistics.median(
                r["bytes"] / r["reader_read_s"] / 1e9 for r in second),
            "reader_vmhwm_bytes": max(r["reader_VmHWM"] for r in rounds),
            "reader_rssanon_growth_bytes_per_checkpoint_second_half": grow("reader_RssAnon"),
        } if a.reader else {}),
    }


def markdown(a: argparse.Namespace, s: dict, rounds: list[dict]) -> str:
    lines = [
        f"## Steady state: {a.checkpoints} checkpoints of {a.files} shards "
        f"({s['checkpoint_bytes'] / 1e9:.2f} GB each), --keep-local {a.keep_local} "
        f"--keep-shared {a.keep_shared} --gc-grace {a.gc_grace:g}",
        "",
        "| | first half | second half |",
        "|---|---|---|",
        f"| save time, ckptfs / plain directory (median) | {s['save_ratio_first_half']:.2f} | "
        f"{s['save_ratio_second_half']:.2f} |",
        f"| `ckptfs wait` after the save, s (median) | {s['wait_s_first_half']:.2f} | "
        f"{s['wait_s_second_half']:.2f} |",
        *([f"| reader node: read and check a checkpoint, GB/s (median) | "
           f"{s['reader_read_gbps_first_half']:.3f} | {s['reader_read_gbps_second_half']:.3f} |"]
          if a.reader else []),
        "",
        f"- daemon peak RSS (VmHWM) {s['vmhwm_bytes'] / MiB:.0f} MiB; growth per checkpoint "
        f"over the second half: VmHWM "
        f"{s['vmhwm_growth_bytes_per_checkpoint_second_half'] / MiB:+.2f} MiB, RssAnon "
        f"{s['rssanon_growth_bytes_per_checkpoint_second_half'] / MiB:+.2f} MiB",
        *([f"- reader node: peak RSS (VmHWM) {s['reader_vmhwm_bytes'] / MiB:.0f} MiB; RssAnon "
           f"growth per checkpoint over the second half "
           f"{s['reader_rssanon_growth_bytes_per_checkpoint_second_half'] / MiB:+.2f} MiB; "
           f"every byte of every checkpoint checked"] if a.reader else []),
        f"- NVME at most {s['nvme_max_checkpoints']:.1f} checkpoints' worth "
        f"(keeps {a.keep_local}, plus the one being written)",
        f"- SHARED at most {s['shared_max_checkpoints']:.1f} checkpoints' worth "
        f"({s['shared_last_half_max_checkpoints']:.1f} in the second half; keeps "
        f"{a.keep_shared}, plus what GC's grace and interval have not reached yet)",
        "",
        "| checkpoint | ckptfs save s | plain save s | wait s | VmHWM MiB | RssAnon MiB | "
        "NVME MiB | SHARED MiB |" + (" reader read s | reader RssAnon MiB |" if a.reader else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if a.reader else ""),
    ]
    for r in rounds:
        lines.append(
            f"| {r['checkpoint']} | {r['ckptfs_save_s']:.2f} | {r['plain_save_s']:.2f} | "
            f"{r['wait_s']:.2f} | {r.get('VmHWM', 0) / MiB:.0f} | "
            f"{r.get('RssAnon', 0) / MiB:.0f} | {r['nvme_bytes'] / MiB:.0f} | "
            f"{r['shared_bytes'] / MiB:.0f} |"
            + (f" {r['reader_read_s']:.2f} | {r['reader_RssAnon'] / MiB:.0f} |"
               if a.reader else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ckptfs-steady-", dir=a.workdir))
    try:
        t0 = time.monotonic()
        out = run(a, work)
        s = summarize(a, out["rounds"])
        md = markdown(a, s, out["rounds"])
        print("\n" + md)
        results = Path(a.results_dir)
        results.mkdir(parents=True, exist_ok=True)
        prefix = results / time.strftime("steady-%Y%m%d-%H%M%S")
        prefix.with_suffix(".json").write_text(json.dumps(
            {"args": vars(a), "summary": s, **out, "seconds": time.monotonic() - t0,
             "ckptfs": source_fingerprint()}, indent=1))
        prefix.with_suffix(".md").write_text(md)
        print(f"results: {prefix}.json, {prefix}.md")
        return 0
    finally:
        shutdown_pool()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
