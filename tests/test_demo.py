"""`ckptfs demo` (what `bash scripts/demo.sh`, the README's first command, runs): a small storm
end to end, through the real CLI, mount to cleanup. It must succeed, report what it measured,
verify every byte from SHARED, and leave no mount, daemon or directory behind."""

from __future__ import annotations

import os
import re
from pathlib import Path

from mounting import fuse_mounts_under, lazy_unmount_all_under, pids_with_arg, run_cli


def test_demo_runs_end_to_end_and_leaves_nothing_behind(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    work.mkdir()
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
        assert os.listdir(work) == [], os.listdir(work)  # every directory it made is gone
    finally:
        lazy_unmount_all_under(work)
