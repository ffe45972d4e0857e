"""The seed's sizing tools: `ckptfs plan` does the three steps' arithmetic (checked here against
the formulas in docs/cli.md, including what batch publishing does to the shared-store count), and
`ckptfs probe` measures a real target: against the NAS emulator with a known metadata rate and
fsync latency it must see that rate and that latency, and leave nothing behind."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from test_shared_support import assert_one_line_error, cli

REPO = Path(__file__).resolve().parent.parent


def plan(*args: str) -> dict:
    return json.loads(cli("plan", "--size", "50GB", "--interval", "10m", "--budget", "30s",
                          *args, "--json").stdout)


def test_plan_follows_the_seeds_three_steps_and_counts_batched_publishes() -> None:
    p = plan("--ranks", "64", "--files-per-rank", "8", "--nodes", "4", "--segment-size", "256MiB")
    assert p["files"] == 64 * 8 + 1
    assert p["metadata_ops"] == 3 * p["files"]
    assert math.isclose(p["required_bandwidth"], 50e9 / 30)
    assert math.isclose(p["nvme_bandwidth_per_node"], 50e9 / 30 / 4)
    per_node = math.ceil(50e9 / 4 / (256 << 20))  # 47
    assert p["segments"] == 4 * per_node
    # per node: two batches of 16 (2k + 4 each), one of 15, and the manifest
    assert p["shared_ops"] == 4 * (2 * (2 * 16 + 4) + (2 * 15 + 4) + 4), p["shared_ops"]
    one_by_one = plan("--ranks", "64", "--files-per-rank", "8", "--nodes", "4",
                      "--publish-batch", "1")
    assert one_by_one["shared_ops"] == 4 * (per_node * 4 + 4)
    assert p["shared_ops"] < one_by_one["shared_ops"] < p["metadata_ops"]
    direct = plan("--ranks", "64", "--files-per-rank", "8", "--nas-creates", "3000",
                  "--nas-bandwidth", "2GB/s")
    assert math.isclose(direct["nas_metadata_seconds"], direct["metadata_ops"] / 3000)
    assert math.isclose(direct["nas_data_seconds"], 50e9 / 2e9)
    res = cli("plan", "--size", "50GB", "--interval", "10s", "--budget", "30s", "--ranks", "8",
              check=False)
    assert "budget" in assert_one_line_error(res, "a budget longer than the interval")


def test_plan_and_probe_refuse_values_that_mean_nothing(tmp_path: Path) -> None:
    """Each with one line: a zero segment size divided by zero (a traceback), negative
    retention counts gave a negative capacity, a NAS of 0 creates/s or 0 bytes/s was taken,
    and `probe --seconds 0` measured nothing and died computing a median."""
    base = ["plan", "--size", "50GB", "--interval", "10m", "--budget", "30s", "--ranks", "8"]
    for extra, word in ((["--segment-size", "0"], "segment-size"),
                        (["--segment-size", "1"], "segment-size"),
                        (["--nas-creates", "0"], "nas-creates"),
                        (["--nas-bandwidth", "0"], "nas-bandwidth")):
        res = cli(*base, *extra, check=False)
        assert word in assert_one_line_error(res, " ".join(extra)), res.stderr
    for extra in (["--keep-local", "-1"], ["--keep-shared", "-2"]):
        res = cli(*base, *extra, check=False)
        assert res.returncode == 2 and "must not be negative" in res.stderr, res.stderr
    res = cli("probe", str(tmp_path), "--seconds", "0", check=False)
    assert res.returncode == 2 and "must be more than 0" in res.stderr, res.stderr
    assert os.listdir(tmp_path) == []


def test_probe_measures_the_emulated_nas_and_cleans_up(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO))
    from bench.nasemu import NasEmu

    # 200 metadata ops/s; every create and fsync costs a 5 ms round trip
    with NasEmu(tmp_path / "backing", tmp_path / "nas", meta_latency_us=5000,
                meta_ops_per_sec=200, bandwidth_mbps=0, log_path=tmp_path / "nasemu.log") as nas:
        target = nas.mountpoint / "ckpt"
        target.mkdir()
        res = subprocess.run([sys.executable, "-m", "ckptfs", "probe", str(target), "--seconds",
                              "1", "--max-bytes", "16M", "--json"], capture_output=True,
                             text=True, timeout=120, cwd=REPO)
        assert res.returncode == 0, res.stderr
        r = json.loads(res.stdout)
        assert os.listdir(target) == [], "probe left files behind"
    # a create is one metadata op (the file's fsync and close are others): at most 200/s
    assert 10 <= r["creates_per_s"] <= 200 * 1.2, r
    assert r["fsync_latency_ms_p50"] >= 5.0, r
    assert r["write_bandwidth"] > 0 and r["read_bandwidth"] > 0 and r["bytes_used"] > 0, r
