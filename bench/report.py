"""Turning one run's measurements into ratios (met / not met), a Markdown table and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TARGETS = {
    "ckptfs": "(a) ckptfs over emulated NAS",
    "nas": "(b) straight to emulated NAS",
    "nvme": "(c) straight to NVMe filesystem",
}
WORKLOADS = {"storm": "Storm", "big": "Few big shards"}
GB = 1e9
MiB = 1 << 20


def get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _div(a: Any, b: Any) -> float | None:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
        return a / b
    return None


def _check(
    name: str, value: float | None, op: str, bound: float, detail: str, why_na: str = ""
) -> dict:
    if value is None:
        met = None
    elif op == ">=":
        met = value >= bound
    else:
        met = value <= bound
    return {
        "name": name,
        "value": value,
        "op": op,
        "bound": bound,
        "met": met,
        "detail": detail,
        "note": why_na if value is None else "",
    }


def ratios(res: dict, ns_constant: int) -> list[dict]:
    """Every target ratio of the brief, each with the figures it came from."""
    W = res.get("workloads", {})
    out = []
    ck, nas, nv = (get(W, "storm", t) for t in ("ckptfs", "nas", "nvme"))
    ck_s, nas_s, nv_s = (
        get(ck, "save", "seconds"),
        get(nas, "save", "seconds"),
        get(nv, "save", "seconds"),
    )
    why = get(ck, "error") or get(nas, "error") or ""
    nodes = get(res, "config", "cluster_nodes") or 1
    hint = ""
    if nodes == 1 and isinstance(nas_s, (int, float)) and isinstance(nv_s, (int, float)) \
            and nas_s < 2 * nv_s:
        # the figure is honest but easy to misread: say why it is what it is
        hint = (" (the whole NAS serves this node's ranks alone, no storm for it: "
                "see --cluster-nodes)")
    out.append(
        _check(
            "storm save: NAS / ckptfs",
            _div(nas_s, ck_s),
            ">=",
            20.0,
            f"NAS {_f(nas_s)} s, ckptfs {_f(ck_s)} s{hint}",
            why or "not run",
        )
    )
    out.append(
        _check(
            "storm save: ckptfs / NVMe",
            _div(ck_s, nv_s),
            "<=",
            1.5,
            f"ckptfs {_f(ck_s)} s, NVMe {_f(nv_s)} s",
            get(nv, "error") or why or "not run",
        )
    )
    for w in ("storm", "big"):
        c = get(W, w, "ckptfs")
        ns = get(c, "shared", "checkpoint", "namespace_ops")
        segs = get(c, "segments")
        bound = (segs + ns_constant) if isinstance(segs, int) else None
        val = _div(ns, bound) if bound else None
        out.append(
            _check(
                f"{w}: shared namespace ops / (segments + {ns_constant})",
                val,
                "<=",
                1.0,
                f"{_i(ns)} namespace ops on SHARED, {_i(segs)} segments",
                get(c, "segments_note") or get(c, "error") or "not run",
            )
        )
    b_ck, b_nv = get(W, "big", "ckptfs", "save", "gbps"), get(W, "big", "nvme", "save", "gbps")
    out.append(
        _check(
            "big shards: write GB/s ckptfs / NVMe",
            _div(b_ck, b_nv),
            ">=",
            0.70,
            f"ckptfs {_f(b_ck)} GB/s, NVMe {_f(b_nv)} GB/s",
            get(W, "big", "ckptfs", "error") or "not run",
        )
    )
    ref = get(res, "calibration", "nas_seq_write_gbps")
    d = get(res, "drain_test", "gbps")
    out.append(
        _check(
            "drain with a backlog GB/s / NAS sequential write (zero latency)",
            _div(d, ref),
            ">=",
            0.90,
            f"drain {_f(d)} GB/s, NAS seq {_f(ref)} GB/s",
            get(res, "drain_test", "note") or get(res, "drain_test", "error") or "not run",
        )
    )
    for w in ("storm", "big"):
        cold = get(W, w, "ckptfs", "restore_cold", "gbps")
        base = get(W, w, "ckptfs", "shared_read_cold", "gbps")
        out.append(
            _check(
                f"{w}: cold restore GB/s ckptfs / shared dir",
                _div(cold, base),
                ">=",
                0.80,
                f"ckptfs {_f(cold)} GB/s, shared dir {_f(base)} GB/s",
                get(W, w, "ckptfs", "restore_cold", "note") or "not run",
            )
        )
    rss = [get(W, w, "ckptfs", "daemon", "rss_peak_bytes") for w in W]
    rss = [r for r in rss if isinstance(r, int)]
    peak = max(rss) / MiB if rss else None
    out.append(
        _check(
            "daemon peak RSS (MiB)",
            peak,
            "<=",
            300.0,
            f"{_f(peak, 1)} MiB (VmHWM)",
            "daemon not measured",
        )
    )
    for key, what in (("replay", "cold page cache"), ("replay_warm", "log in page cache")):
        rep = [get(W, w, "ckptfs", key, "bytes_per_s") for w in W]
        rep = [r for r in rep if isinstance(r, (int, float))]
        low = min(rep) / GB if rep else None
        note = next(
            (get(W, w, "ckptfs", key, "note") for w in W if get(W, w, "ckptfs", key, "note")),
            "not run",
        )
        out.append(
            _check(f"replay GB/s of log, {what} (slowest)", low, ">=", 1.0, f"{_f(low)} GB/s", note)
        )
    fid_w = get(res, "calibration", "fidelity_write")
    fid_r = get(res, "calibration", "fidelity_read")
    out.append(
        _check(
            "emulator fidelity: write GB/s nasemu(no limits) / raw dir",
            fid_w,
            ">=",
            0.80,
            "an emulator slower than the disk would flatter ckptfs",
            "not run",
        )
    )
    out.append(
        _check(
            "emulator fidelity: cold read GB/s nasemu(no limits) / raw dir",
            fid_r,
            ">=",
            0.80,
            "",
            "not run",
        )
    )
    return out


def _f(v: Any, nd: int = 3) -> str:
    return f"{v:.{nd}f}" if isinstance(v, (int, float)) else "n/a"


def _i(v: Any) -> str:
    return str(v) if isinstance(v, int) else "n/a"


def _mark(met: bool | None) -> str:
    return {True: "met", False: "NOT MET", None: "n/a"}[met]


def markdown(res: dict, checks: list[dict]) -> str:
    L = [f"# ckptfs benchmark, {res['started']} ({res['mode']})", ""]
    cfg = res["config"]
    L.append(
        f"Machine: {res['machine']}. Emulated NAS: {cfg['nas']['meta_latency_us']} us per "
        f"metadata op, {cfg['nas']['meta_ops_per_sec']} metadata ops/s shared, "
        f"{cfg['nas']['bandwidth_mbps']} MB/s"
        + (f" (this node's share of a NAS serving {cfg['cluster_nodes']} nodes at once)"
           if cfg.get("cluster_nodes", 1) > 1 else "")
        + f". Ranks: {cfg['ranks']}."
    )
    src = res.get("ckptfs_source") or {}
    la0, la1 = res.get("loadavg_start"), res.get("loadavg_end")
    if src or la0:
        L.append(
            f"ckptfs measured: git {src.get('git_head') or '(no commit)'}, ckptfs/*.py sha256 "
            f"{src.get('ckptfs_py_sha256', '?')}. Load average at start / end: "
            f"{_f(la0[0] if la0 else None, 1)} / {_f(la1[0] if la1 else None, 1)} (2 vCPUs: "
            f"anything above ~2 means other work shared the machine)."
        )
    L.append("")
    L.append("## Ratios")
    L.append("")
    L.append("| check | value | target | result | from |")
    L.append("|---|---|---|---|---|")
    for c in checks:
        L.append(
            f"| {c['name']} | {_f(c['value'], 2)} | {c['op']} {c['bound']:g} | "
            f"{_mark(c['met'])} | {c['detail']}{' — ' + c['note'] if c['note'] else ''} |"
        )
    L.append("")
    for w, wname in WORKLOADS.items():
        wd = get(res, "workloads", w)
        if not wd:
            continue
        shape = get(res, "config", "workloads", w) or {}
        L.append(f"## {wname}: {shape.get('description', '')}")
        L.append("")
        L.append(
            "| target | save s | save GB/s | files/s | file p99 ms | durable s | hot restore GB/s "
            "| cold restore GB/s | NAS meta ops | NAS namespace ops | NAS fsyncs |"
        )
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for t, tname in TARGETS.items():
            d = wd.get(t)
            if d is None:
                continue
            if d.get("error") and not d.get("save"):
                L.append(f"| {tname} | failed: {d['error'][:120]} |" + " |" * 9)
                continue
            sh = get(d, "shared", "checkpoint") or {}
            L.append(
                f"| {tname} | {_f(get(d, 'save', 'seconds'), 2)} | {_f(get(d, 'save', 'gbps'))} | "
                f"{_f(get(d, 'save', 'files_per_s'), 0)} | "
                f"{_f(get(d, 'save', 'file_latency_ms', 'p99'), 1)} | "
                f"{_f(get(d, 'durable_s'), 2)} | {_f(get(d, 'restore_hot', 'gbps'))} | "
                f"{_f(get(d, 'restore_cold', 'gbps'))} | {_i(sh.get('meta_ops'))} | "
                f"{_i(sh.get('namespace_ops'))} | {_i(sh.get('fsyncs'))} |"
            )
        c = wd.get("ckptfs") or {}
        extra = []
        if c.get("daemon"):
            dm = c["daemon"]
            extra.append(
                f"daemon peak RSS {_f((dm.get('rss_peak_bytes') or 0) / MiB, 0)} MiB, "
                f"CPU {_f(dm.get('cpu_s'), 1)} s"
            )
        if c.get("drain"):
            dr = c["drain"]
            extra.append(
                f"drain {_f(dr.get('gbps'))} GB/s ({dr.get('basis', '')}), "
                f"{_f((dr.get('bytes') or 0) / GB)} GB to SHARED, "
                f"window {_f(dr.get('window_s'), 2)} s"
            )
        if c.get("umount_s") is not None:
            extra.append(f"umount {_f(c['umount_s'], 2)} s")
        for key, what in (("replay", "replay"), ("replay_warm", "warm replay")):
            rp = c.get(key)
            if not rp:
                continue
            extra.append(
                f"{what} {_f((rp.get('bytes_per_s') or 0) / GB)} GB/s of "
                f"{_f((rp.get('log_bytes') or 0) / GB)} GB log (wall {_f(rp.get('wall_s'), 2)} s)"
            )
        if c.get("shared_read_cold"):
            extra.append(f"shared dir cold read {_f(c['shared_read_cold'].get('gbps'))} GB/s")
        if c.get("segments") is not None:
            extra.append(f"segments {c['segments']}")
        rep = c.get("ckptfs_reported") or {}
        if rep:
            extra.append(
                "ckptfs status: "
                + ", ".join(f"{k} {v}" for k, v in rep.items() if v not in (None, {}, []))
            )
        notes = [n for n in (c.get("notes") or [])]
        if extra or notes:
            L.append("")
            L.append("ckptfs: " + "; ".join(extra))
            for n in notes:
                L.append(f"- {n}")
        L.append("")
    dr = res.get("drain_test") or {}
    if dr:
        L.append("## Drain with a backlog")
        L.append("")
        if dr.get("error"):
            L.append(f"failed: {dr['error']}")
        else:
            sd = dr.get("save_drain_held") or {}
            L.append(
                f"Big shards saved through ckptfs while the NAS held every write: "
                f"{_f(sd.get('seconds'), 2)} s ({_f(sd.get('gbps'))} GB/s, the save without a "
                f"competing drain). Released: {_f((dr.get('bytes') or 0) / GB)} GB reached "
                "SHARED in "
                f"{_f(dr.get('seconds'), 2)} s = {_f(dr.get('gbps'))} GB/s "
                "(NAS at zero latency); `ckptfs wait` returned after "
                f"{_f(dr.get('durable_s'), 2)} s "
                f"({_f(dr.get('gbps_to_durable'))} GB/s to durable). {dr.get('note', '')}"
            )
            pc = dr.get("plain_copy") or {}
            if pc.get("gbps"):
                L.append("")
                L.append(
                    f"The same segment files copied to the NAS (zero latency) by 2 plain streams "
                    f"(sendfile, fsync each; page cache dropped): {_f(pc['gbps'])} GB/s. The "
                    f"drain reached {_f(_div(dr.get('gbps'), pc['gbps']), 2)}x of that: on one "
                    "disk a drain reads the log back while it writes the objects."
                )
        L.append("")
    cal = res.get("calibration") or {}
    if cal:
        L.append("## Emulator calibration (same run)")
        L.append("")
        L.append("| run | write GB/s (best) | cold read GB/s (best) | write rounds | read rounds |")
        L.append("|---|---|---|---|---|")
        for k, v in (cal.get("runs") or {}).items():
            L.append(
                f"| {k} | {_f(v.get('write_gbps'))} | {_f(v.get('read_gbps'))} | "
                f"{', '.join(_f(x, 2) for x in v.get('write_rounds', []))} | "
                f"{', '.join(_f(x, 2) for x in v.get('read_rounds', []))} |"
            )
        L.append("")
        L.append(
            f"nasemu with no latency and no caps / raw directory, best of {cal.get('rounds')} "
            f"alternating rounds each: write {_f(cal.get('fidelity_write'), 2)}x, cold read "
            f"{_f(cal.get('fidelity_read'), 2)}x "
            f"(medians: {_f(cal.get('fidelity_write_median'), 2)}x, "
            f"{_f(cal.get('fidelity_read_median'), 2)}x). NAS sequential write reference for the "
            f"drain (best emulator write at zero latency in any round above, never above the "
            f"cap): {_f(cal.get('nas_seq_write_gbps'))} GB/s."
        )
        L.append("")
    if res.get("errors"):
        L.append("## Errors")
        L.append("")
        for e in res["errors"]:
            L.append(f"- {e}")
        L.append("")
    L.append(f"Total run time {res.get('elapsed_s', 0):.0f} s.")
    return "\n".join(L) + "\n"


def plots(res: dict, out_prefix: Path) -> list[str]:
    """Save time and bandwidth per target as PNGs; [] (and a note) if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        res.setdefault("notes", []).append("matplotlib not installed: no plots")
        return []
    files = []
    W = res.get("workloads", {})
    colors = {"ckptfs": "#1f77b4", "nas": "#d62728", "nvme": "#2ca02c"}
    fig, axes = plt.subplots(1, len(W) or 1, figsize=(5 * max(1, len(W)), 4), squeeze=False)
    for ax, (w, wd) in zip(axes[0], W.items()):
        names, vals, cols = [], [], []
        for t in TARGETS:
            v = get(wd, t, "save", "seconds")
            if isinstance(v, (int, float)):
                names.append(t)
                vals.append(v)
                cols.append(colors[t])
        ax.bar(names, vals, color=cols)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}s", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{WORKLOADS.get(w, w)}: training-visible save time")
        ax.set_ylabel("seconds (lower is better)")
    fig.tight_layout()
    p = out_prefix.with_name(out_prefix.name + "-save-time.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(str(p))

    fig, axes = plt.subplots(1, len(W) or 1, figsize=(6 * max(1, len(W)), 4), squeeze=False)
    kinds = [("save", "write"), ("restore_hot", "hot read"), ("restore_cold", "cold read")]
    for ax, (w, wd) in zip(axes[0], W.items()):
        width = 0.25
        for j, t in enumerate(TARGETS):
            vals = [get(wd, t, k, "gbps") or 0 for k, _ in kinds]
            xs = [i + (j - 1) * width for i in range(len(kinds))]
            ax.bar(xs, vals, width, label=t, color=colors[t])
        ax.set_xticks(range(len(kinds)))
        ax.set_xticklabels([n for _, n in kinds])
        ax.set_ylabel("GB/s (higher is better)")
        ax.set_title(f"{WORKLOADS.get(w, w)}: bandwidth")
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = out_prefix.with_name(out_prefix.name + "-bandwidth.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(str(p))
    return files


def save_json(res: dict, path: Path) -> None:
    path.write_text(json.dumps(res, indent=2, default=str) + "\n")
