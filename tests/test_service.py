"""Service integration: the fstab helper (mount.ckptfs), mount(8) with it, the systemd unit."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mounting import (fuse_mounts_under, is_mounted, lazy_unmount_all_under, mount_entry,
                      run_cli)

HELPER = Path(sys.executable).with_name("mount.ckptfs")
REPO = Path(__file__).resolve().parent.parent


def dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    out = tuple(tmp_path / d for d in ("nvme", "shared", "mnt"))
    for d in out:
        d.mkdir()
    return out  # type: ignore[return-value]


def _cleanup(tmp_path: Path) -> None:
    for m in fuse_mounts_under(tmp_path):
        run_cli("umount", m, "--no-drain", timeout=60)
    lazy_unmount_all_under(tmp_path)


def test_fstab_helper_maps_options(tmp_path: Path) -> None:
    nvme, shared, mnt = dirs(tmp_path)
    try:
        res = subprocess.run([str(HELPER), f"{nvme}:{shared}", str(mnt), "-o",
                              "rw,node_id=fstab0,keep_shared=3,_netdev,x-systemd.automount"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert is_mounted(mnt)
        # the source column says which directories this is, as for any other filesystem
        assert mount_entry(mnt)[0] == f"{nvme}:{shared}"  # type: ignore[index]
        st = json.loads(run_cli("status", mnt, "--json").out)
        assert st["node_id"] == "fstab0"
        assert st["retention"]["keep_shared"] == 3
        (mnt / "f").write_bytes(b"via fstab")
        # `mount -o remount,ro` (mount(8) runs the helper for it): read-only, then writable
        for opt in ("remount,ro", "remount,rw"):
            res = subprocess.run([str(HELPER), f"{nvme}:{shared}", str(mnt), "-o", opt],
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
            if opt.endswith("ro"):
                with pytest.raises(OSError) as exc:
                    (mnt / "g").write_bytes(b"x")
                assert exc.value.errno == errno.EROFS
                assert (mnt / "f").read_bytes() == b"via fstab"
        (mnt / "g").write_bytes(b"writable again")
        assert run_cli("umount", mnt).rc == 0
        assert not is_mounted(mnt, None)
        bad = subprocess.run([str(HELPER), str(nvme), str(mnt)], capture_output=True, text=True)
        assert bad.returncode == 2 and "usage: mount.ckptfs" in bad.stderr
    finally:
        _cleanup(tmp_path)


@pytest.mark.skipif(os.path.exists("/sbin/mount.ckptfs"), reason="a mount.ckptfs is installed")
def test_mount_8_runs_the_helper(tmp_path: Path) -> None:
    nvme, shared, mnt = dirs(tmp_path)
    link = Path("/sbin/mount.ckptfs")
    link.symlink_to(HELPER)
    try:
        res = subprocess.run(["mount", "-t", "ckptfs", f"{nvme}:{shared}", str(mnt), "-o",
                              "node_id=viamount"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert is_mounted(mnt)
        assert json.loads(run_cli("status", mnt, "--json").out)["node_id"] == "viamount"
        assert run_cli("umount", mnt).rc == 0
    finally:
        link.unlink()
        _cleanup(tmp_path)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = (REPO / "docs" / "examples" / "ckptfs@.service").read_text()
    # point it at this installation's ckptfs
    unit = unit.replace("/opt/ckptfs-venv/bin/", str(Path(sys.executable).parent) + "/")
    path = tmp_path / "ckptfs@.service"
    path.write_text(unit)
    inst = tmp_path / "ckptfs@job.service"
    inst.symlink_to(path)
    res = subprocess.run(["systemd-analyze", "verify", str(inst)], capture_output=True,
                         text=True, timeout=60)
    # any complaint about our unit (unknown keys, bad syntax, missing executables) fails
    problems = [ln for ln in (res.stdout + res.stderr).splitlines() if str(tmp_path) in ln]
    assert res.returncode == 0 and not problems, res.stdout + res.stderr
