"""Helpers for the drain / shared-store / multi-node tests (this module holds no tests).

Run as a script it is the storm writer: `python test_shared_support.py write ROOT SPEC.json`
writes the files SPEC lists, with contents from `blob`, so the test can recompute what each
file must hold without passing the bytes around.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mounting import STOP_TIMEOUT, MakeMount, Mount, ckptfs_cmd, iter_files, wait_for

# Small segments and short timers so tests see seals, uploads and refreshes within seconds.
SEGMENT = "4M"
SEGMENT_BYTES = 4 << 20
REFRESH = 1.0
CLI_TIMEOUT = 120.0


# -- contents ----------------------------------------------------------------------------------


def blob(key: str, size: int) -> bytes:
    """Deterministic, incompressible bytes for `key` (same in every process)."""
    return random.Random(key).randbytes(size)


def storm_size(rel: str, lo: int = 512, hi: int = 16 << 10) -> int:
    return lo + zlib.crc32(rel.encode()) % (hi - lo)


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in iter_files(root)}


def tree_diff(expected: dict[str, bytes], got: dict[str, bytes], limit: int = 8) -> list[str]:
    """Human-readable differences between two {relpath: bytes} maps (empty = equal)."""
    out = []
    for rel in sorted(set(expected) | set(got)):
        a, b = expected.get(rel), got.get(rel)
        if a == b:
            continue
        if a is None:
            out.append(f"{rel}: unexpected ({len(b or b'')} bytes)")
        elif b is None:
            out.append(f"{rel}: missing (expected {len(a)} bytes)")
        else:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(f"{rel}: expected {len(a)} bytes, got {len(b)}; first difference at "
                       f"byte {first}")
        if len(out) >= limit:
            out.append("...")
            break
    return out


def assert_tree(expected: dict[str, bytes], root: Path, what: str) -> None:
    got = read_tree(root)
    diff = tree_diff(expected, got)
    assert not diff, f"{what} differs from what was written:\n  " + "\n  ".join(diff)


def assert_files(expected: dict[str, bytes], root: Path, what: str) -> None:
    """Every expected file under root reads back exactly (other files may exist)."""
    got = {}
    for rel in expected:
        try:
            got[rel] = (root / rel).read_bytes()
        except FileNotFoundError:
            pass
    diff = tree_diff(expected, got)
    assert not diff, f"{what}: files differ from what was written:\n  " + "\n  ".join(diff)


# -- nodes ----------------------------------------------------------------------------------


def node_args(node: str, *extra: str, refresh: float = REFRESH) -> list[str]:
    return ["--node-id", node, "--seal-idle", "1", "--refresh-interval", str(refresh),
            *extra]


def start_node(make_mount: MakeMount, name: str, node: str, shared: Path | None = None,
               extra: Sequence[str] = (), segment_size: str = SEGMENT,
               refresh: float = REFRESH) -> Mount:
    """A started mount `name` (its own NVME and MNT) as node `node` on SHARED `shared` (or its
    own SHARED when None)."""
    m = make_mount(name, node_args(node, *extra, refresh=refresh), segment_size=segment_size,
                   start=False)
    if shared is not None:
        m.shared = shared
    m.start()
    return m


# -- the CLI ---------------------------------------------------------------------------------


def cli(*args: str | os.PathLike[str], check: bool = True, timeout: float = CLI_TIMEOUT,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`env`: added to this process's environment."""
    res = subprocess.run(ckptfs_cmd(*args), check=False, capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL,
                         env={**os.environ, **env} if env else None)
    if check and res.returncode != 0:
        raise AssertionError(f"ckptfs {' '.join(map(str, args))} exited {res.returncode}\n"
                             f"stdout: {res.stdout[-3000:]}\nstderr: {res.stderr[-3000:]}")
    return res


def assert_one_line_error(res: subprocess.CompletedProcess[str], what: str) -> str:
    """A failing CLI call printed one clear `ckptfs: error:` line and no traceback."""
    assert res.returncode != 0, f"{what}: expected failure, got exit 0\n{res.stdout}"
    assert "Traceback" not in res.stderr, f"{what}: traceback instead of an error:\n{res.stderr}"
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ckptfs: error:")]
    assert len(errors) == 1, f"{what}: expected one 'ckptfs: error:' line, stderr:\n{res.stderr}"
    return errors[0]


def status(m: Mount, refresh: bool = False) -> dict[str, Any]:
    args: list[str] = ["status", str(m.mnt), "--json"]
    if refresh:
        args.append("--refresh")
    return json.loads(cli(*args).stdout)


def control(m: Mount, req: dict[str, Any]) -> dict[str, Any]:
    from ckptfs import control as ctl

    sock, _ = ctl.find_socket(str(m.mnt))
    return ctl.request(sock, req, timeout=60)


def wait_published(path: Path, timeout: float = 60) -> None:
    cli("wait", path, "--timeout", str(timeout), timeout=timeout + 30)


def ls_json(shared: Path, path: str = "") -> list[dict[str, Any]]:
    """`ckptfs ls SHARED [PATH] --files --json`: every published entry (without --files and
    PATH, ls shows the checkpoint table instead)."""
    args: list[str] = ["ls", str(shared)]
    if path:
        args.append(path)
    return json.loads(cli(*args, "--files", "--json").stdout)


def export_files(shared: Path, path: str, dest: Path) -> dict[str, bytes]:
    """`ckptfs export SHARED path DEST`, then DEST's files as {path relative to path: bytes}."""
    cli("export", shared, path, dest)
    return read_tree(dest)


def fsck(shared: Path, deep: bool = True) -> tuple[int, dict[str, Any], str]:
    args: list[str] = ["fsck", str(shared), "--json"]
    if deep:
        args.append("--deep")
    res = cli(*args, check=False)
    assert "Traceback" not in res.stderr, res.stderr
    return res.returncode, json.loads(res.stdout), res.stderr


def assert_fsck_clean(shared: Path) -> dict[str, Any]:
    rc, rep, err = fsck(shared)
    assert rc == 0 and not rep["problems"], f"fsck --deep found problems: {rep}\n{err}"
    return rep


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# -- the shared store's layout ---------------------------------------------------------------


def store_root(shared: Path) -> Path:
    return shared / "ckptfs"


def store_files(shared: Path) -> list[Path]:
    return sorted(iter_files(store_root(shared)))


def objects(shared: Path, node: str) -> list[Path]:
    """node's published objects: files in objects/<node>/ and in its batch directories."""
    d = store_root(shared) / "objects" / node
    if not d.is_dir():
        return []
    return sorted([*d.glob("[0-9a-f]*.seg"), *d.glob("b*-*/[0-9a-f]*.seg")],
                  key=lambda p: p.name)


def batch_dirs(shared: Path, node: str) -> list[Path]:
    d = store_root(shared) / "objects" / node
    return sorted(p for p in d.glob("b*-*") if p.is_dir()) if d.is_dir() else []


def manifests(shared: Path, node: str) -> list[Path]:
    d = store_root(shared) / "manifests" / node
    return sorted(p for p in d.iterdir() if p.name.endswith(".manifest")) if d.is_dir() else []


def temp_files(shared: Path) -> list[Path]:
    """Files under a temporary name, or inside a batch directory's temporary name."""
    root = store_root(shared)
    return [p for p in iter_files(root)
            if any(part.startswith(".tmp") for part in p.relative_to(root).parts)]


def encode_manifest(body: dict[str, Any]) -> bytes:
    """A manifest in ckptfs's own container (magic, xxh3_64, zlib JSON): only the content of
    `body` can be wrong, never the wrapping."""
    import xxhash

    from ckptfs import manifest

    raw = zlib.compress(json.dumps(body, separators=(",", ":")).encode(), 3)
    return manifest.MAGIC + struct.pack("<Q", xxhash.xxh3_64_intdigest(raw)) + raw


def decode_manifest(data: bytes) -> dict[str, Any]:
    return json.loads(zlib.decompress(data[16:]))


def put_manifest(shared: Path, node: str, seq: int, data: bytes) -> Path:
    d = store_root(shared) / "manifests" / node
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{seq:016x}.manifest"
    p.write_bytes(data)
    return p


def wait_status(m: Mount, cond: Any, timeout: float, what: str) -> dict[str, Any]:
    """Poll `ckptfs status --json` until cond(status) holds; returns that status."""
    last: dict[str, Any] = {}

    def check() -> bool:
        nonlocal last
        last = status(m)
        return bool(cond(last))

    try:
        wait_for(check, timeout, what, interval=0.05)
    except TimeoutError as e:
        raise AssertionError(f"{e}; last status: { {k: last.get(k) for k in STATUS_KEYS} }\n"
                             f"{m.log_tail()}") from None
    return last


STATUS_KEYS = ("bytes_written", "bytes_uploaded", "bytes_pending_upload", "segments",
               "last_error", "published_seq", "log_seq", "shared_ops", "cache")


def walk_mount(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in iter_files(root)}


def reap_after_cli_umount(m: Mount) -> int:
    """The daemon of `m` exits after `ckptfs umount`; reap it like the fixture would."""
    assert m.proc is not None
    rc = m._reap(STOP_TIMEOUT)
    assert rc is not None, f"daemon still running after ckptfs umount:\n{m.log_tail()}"
    return rc


# -- the storm writer ---------------------------------------------------------------------------


def storm_paths(rank: int, steps: Iterable[int], per_rank: int) -> list[str]:
    return [f"step_{s}/__{rank}_{i}.distcp" for s in steps for i in range(per_rank)]


def _write_main(root: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    for rel in spec["files"]:
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(blob(rel, storm_size(rel)))
    for rel in spec.get("renamed", []):  # torch.distributed.checkpoint's .metadata pattern
        p = os.path.join(root, rel)
        with open(p + ".tmp", "wb") as f:
            f.write(blob(rel, storm_size(rel)))
        os.rename(p + ".tmp", p)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "write":
        sys.exit(_write_main(sys.argv[2], sys.argv[3]))
    sys.exit(f"usage: {sys.argv[0]} write ROOT SPEC.json")
