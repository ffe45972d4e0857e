"""`ckptfs demo` (what `bash scripts/demo.sh`, the README's first command, runs): a small storm
end to end, through the real CLI, mount to cleanup. It must succeed, report what it measured,
verify every byte from SHARED, and leave no mount, daemon or directory behind."""

from __future__ import annotations

import os
import re
from pathlib import Path

from mounting import fuse_mounts_under, lazy_unmount_all_under, pids_with_arg, run_cli


def test_demo_runs_end_to_end_and_leaves_nothing_behind(tmp_path: Path) -> None:
    work = tmp_path / "demo" / "deep"  # made by the demo, and so removed by it too
    try:
        res = run_cli("demo", "--ranks", "3", "--files-per-rank", "5", "--size-mb", "0.3",
                      "--workdir", work, timeout=240)
        assert res.rc == 0, str(res)
        out = res.out
        assert "Traceback" not in out + res.err, str(res)
        assert "training-visible save through ckptfs" in out, out
        assert "durable on SHARED" in out, out
        # 3 ranks x 5 shards, plus rank 0's .metadata: every byte checked via `ckptfs export`
        m = re.search(r"verified: all (\d+) files exported from SHARED match", out)
        assert m and int(m.group(1)) == 3 * 5 + 1, out
        assert "unmounted" in out, out
        assert fuse_mounts_under(work) == [], fuse_mounts_under(work)
        assert pids_with_arg(str(work)) == [], pids_with_arg(str(work))
        assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # every directory it made
    finally:
        lazy_unmount_all_under(work)


def test_demo_on_a_given_shared_directory(tmp_path: Path) -> None:
    """`--shared DIR` (try ckptfs on your own NAS): SHARED and the straight save's directory are
    made under DIR, the log is not; with --keep both stay, and the objects are in DIR."""
    work, nas = tmp_path / "local", tmp_path / "nas"
    work.mkdir()
    nas.mkdir()
    try:
        res = run_cli("demo", "--ranks", "2", "--files-per-rank", "3", "--size-mb", "0.2",
                      "--workdir", work, "--shared", nas, "--keep", timeout=240)
        assert res.rc == 0, str(res)
        assert "verified: all 7 files exported from SHARED match" in res.out, res.out
        assert "--shared" in res.out, res.out  # the note for a store of the user's own
        [local] = os.listdir(work)
        [top] = os.listdir(nas)
        assert sorted(os.listdir(work / local)) == ["export", "mnt", "nvme"]
        assert sorted(os.listdir(nas / top)) == ["shared", "shared-plain"]
        objects = [f for _d, _s, fs in os.walk(nas / top / "shared" / "ckptfs" / "objects")
                   for f in fs]
        assert objects, list(os.walk(nas / top / "shared"))
        assert len(os.listdir(nas / top / "shared-plain" / "step_100")) == 7
        assert fuse_mounts_under(tmp_path) == []
    finally:
        lazy_unmount_all_under(tmp_path)


def test_demo_refuses_a_missing_shared_directory(tmp_path: Path) -> None:
    work = tmp_path / "local"
    work.mkdir()
    res = run_cli("demo", "--workdir", work, "--shared", tmp_path / "nope", timeout=60)
    assert res.rc == 2, str(res)  # a usage error, one line on stderr
    [line] = [ln for ln in res.err.splitlines() if "error" in ln]
    assert "--shared" in line and "not an existing directory" in line, str(res)
    assert "Traceback" not in res.out + res.err, str(res)
    assert os.listdir(work) == []
