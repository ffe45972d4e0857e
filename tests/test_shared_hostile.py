"""SHARED is written by other machines: hostile or corrupt manifests and objects are rejected
with one clear line, `export` never writes outside DEST, mounts stay up and ignore what they
cannot trust, and a read of damaged data is EIO, never wrong bytes.

The hostile manifests are built in ckptfs's own container (magic, xxh3_64, zlib JSON: see
ckptfs/manifest.py) so that only their content is hostile, and they point at a real node's
real objects wherever a valid reference is needed."""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from mounting import MakeMount, Mount, check_errno
from test_shared_support import (
    assert_one_line_error,
    blob,
    cli,
    control,
    decode_manifest,
    drop_caches,
    encode_manifest,
    export_files,
    fsck,
    manifests,
    put_manifest,
    start_node,
    status,
    store_root,
    wait_published,
    write_tree,
)

FAR = 1 << 30  # an extent's record position this far past a real record is past the object
GOOD = {"good/a.bin": blob("ga", 300_000), "good/sub/b.bin": blob("gb", 5 << 20)}


def published_good(make_mount: MakeMount) -> tuple[Mount, dict[str, Any]]:
    """n0 publishes GOOD; returns its mount and the body of its newest manifest."""
    m = start_node(make_mount, "a", "n0")
    write_tree(m.mnt, GOOD)
    cli("wait", m.mnt, "--timeout", "60")
    body = decode_manifest(manifests(m.shared, "n0")[-1].read_bytes())
    return m, body


def file_entry(body: dict[str, Any], path: str) -> dict[str, Any]:
    return copy.deepcopy(next(e for e in body["entries"] if e["path"] == path))


def fake_body(node: str, template: dict[str, Any], entries: list[dict[str, Any]],
              **over: Any) -> dict[str, Any]:
    objs = {x[2]: template["objects"].get(x[2], {}) for e in entries
            for x in e.get("extents", []) if isinstance(x, list) and len(x) == 6}
    body = {"format": "ckptfs-manifest", "version": 1, "node": node, "seq": 1,
            "created_ns": time.time_ns(), "objects": objs, "entries": entries}
    body.update(over)
    return body


def as_path(e: dict[str, Any], path: str, **over: Any) -> dict[str, Any]:
    e = copy.deepcopy(e)
    e["path"] = path
    e.update(over)
    return e


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x20]))


def payload_offset(extent: list[Any]) -> int:
    """An offset inside the data the extent names, in its object."""
    from ckptfs import segment as fmt

    _off, length, _obj, pos, skip, _rec_len = extent
    return pos + fmt.RECORD_HEADER_SIZE + skip + length // 2


def object_path(shared: Path, obj: str) -> Path:
    node, seg = obj.rsplit("/", 1)
    return store_root(shared) / "objects" / node / f"{seg}.seg"


def plant_hostile(shared: Path, body: dict[str, Any], outside: Path) -> tuple[
        dict[str, str], dict[str, str]]:
    """Write the hostile manifests. Returns (node -> what parse must reject it for,
    node -> path whose data is bad although its manifest parses)."""
    a = file_entry(body, "good/a.bin")
    ext = a["extents"][0]
    rejected: dict[str, tuple[list[dict[str, Any]], str]] = {
        "evil-dotdot": ([as_path(a, "../escape.bin")], "bad path"),
        "evil-dotdot2": ([as_path(a, "good/../../escape.bin")], "bad path"),
        "evil-abs": ([as_path(a, str(outside / "abs_escape.bin"))], "bad path"),
        "evil-nul": ([as_path(a, "nul\0name")], "bad path"),
        "evil-slash": ([as_path(a, "dir//x")], "bad path"),
        "evil-trailing": ([as_path(a, "dir/x/")], "bad path"),
        "evil-dot": ([as_path(a, "./x")], "bad path"),
        "evil-range": ([as_path(a, "r/x", size=ext[1] - 1)], "out of range"),
        "evil-skip": ([as_path(a, "r/y", extents=[[0, ext[1], ext[2], ext[3], ext[5], ext[5]]])],
                      "out of range"),
        "evil-negative": ([as_path(a, "r/z", extents=[[-1] + ext[1:]])], "extent offset"),
        "evil-huge": ([as_path(a, "r/w", size=1 << 70)], "size"),
        "evil-objname": ([as_path(a, "r/v", extents=[ext[:2] + ["../../x/0000000000000001"]
                                                        + ext[3:]])], "bad object name"),
        "evil-type": ([as_path(a, "r/u", type="p")], "bad type"),
    }
    for node, (entries, _why) in list(rejected.items()):
        put_manifest(shared, node, 1, encode_manifest(fake_body(node, body, entries)))
    # an impostor: a manifest under evil-impostor claiming to be n0's
    put_manifest(shared, "evil-impostor", 1, encode_manifest(
        fake_body("n0", body, [as_path(a, "impostor.bin")])))
    rejected["evil-impostor"] = ([], "claims to be from node")
    # truncated: a whole valid manifest cut short
    whole = encode_manifest(fake_body("evil-trunc", body, [as_path(a, "trunc/a.bin")]))
    put_manifest(shared, "evil-trunc", 1, whole[: len(whole) - 7])
    rejected["evil-trunc"] = ([], "checksum mismatch")
    # the container is right, the body is not a manifest
    put_manifest(shared, "evil-body", 1, encode_manifest({"format": "zip", "entries": 5}))
    rejected["evil-body"] = ([], "not a ckptfs manifest")
    # garbage
    put_manifest(shared, "evil-garbage", 1, os.urandom(100))
    rejected["evil-garbage"] = ([], "bad magic")

    # Parses, but the data it names is not there or not right: found when read.
    bad_data: dict[str, str] = {}
    far = [ext[0], ext[1], ext[2], ext[3] + FAR, ext[4], ext[5]]
    put_manifest(shared, "evil-pos", 1, encode_manifest(
        fake_body("evil-pos", body, [as_path(a, "pos/x.bin", extents=[far])])))
    bad_data["evil-pos"] = "pos/x.bin"
    ghost = "ghost/" + ext[2].rsplit("/", 1)[1]
    put_manifest(shared, "evil-ghost", 1, encode_manifest(
        fake_body("evil-ghost", body, [as_path(a, "ghost/x.bin", extents=[
            [x[0], x[1], ghost, x[3], x[4], x[5]] for x in a["extents"]])])))
    bad_data["evil-ghost"] = "ghost/x.bin"
    # a bit-flipped copy of n0's object, published as node evil-flip's
    flip_obj = "evil-flip/" + ext[2].rsplit("/", 1)[1]
    dst = object_path(shared, flip_obj)
    dst.parent.mkdir(parents=True)
    dst.write_bytes(object_path(shared, ext[2]).read_bytes())
    flip_byte(dst, payload_offset(ext))
    entry = as_path(a, "flip/a.bin", extents=[[x[0], x[1], flip_obj, x[3], x[4], x[5]]
                                              for x in a["extents"]])
    put_manifest(shared, "evil-flip", 1, encode_manifest(
        fake_body("evil-flip", body, [entry], objects={flip_obj: body["objects"][ext[2]]})))
    bad_data["evil-flip"] = "flip/a.bin"
    # a symlink out of DEST with a file "inside" it: the manifest is invalid as a whole
    put_manifest(shared, "evil-link", 1, encode_manifest(fake_body("evil-link", body, [
        {"path": "sym", "type": "d", "mode": 0o755, "uid": 0, "gid": 0, "size": 0,
         "mtime_ns": 1},
        {"path": "sym/lnk", "type": "l", "mode": 0o777, "uid": 0, "gid": 0, "size": 0,
         "mtime_ns": 1, "target": str(outside)},
        as_path(a, "sym/lnk/pwned.bin")])))
    return {n: why for n, (_e, why) in rejected.items()}, bad_data


def snapshot(root: Path, *skip: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every entry under root, except the directories in `skip`."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(dirpath, d) not in skip]
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return out


def test_hostile_manifests_are_rejected_and_export_stays_in_dest(make_mount: MakeMount,
                                                                 tmp_path: Path) -> None:
    a, body = published_good(make_mount)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_bytes(b"keep")
    rejected, bad_data = plant_hostile(a.shared, body, outside)

    # ls: a line naming each rejected manifest and why, the good files listed, nothing hostile
    res = cli("ls", a.shared, "--files", "--json")
    assert "Traceback" not in res.stderr, res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert all(w.startswith("ckptfs: ") for w in warnings), res.stderr
    for node, why in rejected.items():
        assert any(node + "/" in w and why in w for w in warnings), (
            f"ls should say why {node} is rejected ({why}); stderr:\n{res.stderr}")
    listed = {e["path"] for e in json.loads(res.stdout)}
    assert set(GOOD) <= listed
    assert not [p for p in listed if ".." in p.split("/") or p.startswith("/") or "\0" in p
                or "escape" in p or "impostor" in p or "trunc" in p], listed

    # fsck: exit 1, every bad manifest and every bad extent reported on one line
    rc, rep, _ = fsck(a.shared)
    assert rc == 1, rep
    problems = rep["problems"]
    assert all("\n" not in p for p in problems), problems
    for node, why in rejected.items():
        if node == "evil-impostor":
            continue  # test_fsck_rejects_a_manifest_filed_under_another_node
        assert any(node + "/" in p and why in p for p in problems), (node, why, problems)
    far = str(file_entry(body, "good/a.bin")["extents"][0][3] + FAR)
    for node, bad in (("evil-pos", far), ("evil-ghost", "ghost/"), ("evil-flip", "evil-flip/")):
        assert any(node in p or bad in p for p in problems), (node, problems)
    text = cli("fsck", a.shared, "--deep", check=False)
    assert text.returncode == 1 and "Traceback" not in text.stderr + text.stdout

    # export: good data exported exactly; bad data refused with one line; nothing outside DEST
    exports = tmp_path / "exports"
    exports.mkdir()
    before = snapshot(tmp_path, exports, a.root)
    dest = exports / "good"
    got = export_files(a.shared, "good", dest)
    assert got == {k.split("/", 1)[1]: v for k, v in GOOD.items()}
    for prefix, why in (("flip", "checksum"), ("pos", ""), ("ghost", ""),
                        ("sym", "nothing published"),
                        ("..", "nothing published"), ("../escape.bin", "nothing published"),
                        (str(outside), "nothing published"), ("trunc", "nothing published"),
                        ("impostor.bin", "nothing published")):
        d = exports / f"x{abs(hash(prefix))}"
        res = cli("export", a.shared, prefix, d, check=False)
        line = assert_one_line_error(res, f"export of {prefix!r}")
        assert why in line, f"export of {prefix!r}: {line!r} does not say {why!r}"
    after = snapshot(tmp_path, exports, a.root)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert not changed, f"export wrote outside DEST: {sorted(changed)}"
    assert sorted(os.listdir(outside)) == ["sentinel"], os.listdir(outside)
    assert not list(tmp_path.glob("**/escape*")) and not list(tmp_path.glob("**/pwned*"))

    # The live mount re-reads manifests: it stays up, logs and ignores the bad ones.
    st = status(a, refresh=True)
    assert st["remote"]["manifest_errors"], st["remote"]
    assert (a.mnt / "good/a.bin").read_bytes() == GOOD["good/a.bin"]
    check_mount_view(a, bad_data)
    log = a.log_path.read_text(errors="replace") if a.log_path else ""
    ignored = [ln for ln in log.splitlines() if "ignoring manifest" in ln]
    for node in rejected:
        assert any(node + "/" in ln for ln in ignored), f"no log line ignoring {node}:\n" + \
            "\n".join(ignored)

    # A node mounting fresh onto this SHARED comes up too, with the same view.
    b = start_node(make_mount, "b", "n1", shared=a.shared)
    for rel, data in GOOD.items():
        assert (b.mnt / rel).read_bytes() == data
    check_mount_view(b, bad_data)


def test_ls_and_export_say_once_which_manifests_they_ignore(make_mount: MakeMount,
                                                             tmp_path: Path) -> None:
    a, body = published_good(make_mount)
    rejected, _bad = plant_hostile(a.shared, body, tmp_path)
    problems = []
    for args in (["ls", a.shared, "--files"], ["export", a.shared, "good", tmp_path / "out"]):
        res = cli(*args)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        counts = {node: sum(node + "/" in ln for ln in lines) for node in rejected}
        wrong = {node: n for node, n in counts.items() if n != 1}
        if wrong:
            problems.append(f"`ckptfs {args[0]}` printed {wrong} lines for these ignored "
                            f"manifests (want 1 each); stderr:\n{res.stderr}")
    assert not problems, "\n".join(problems)


def test_fsck_rejects_a_manifest_filed_under_another_node(make_mount: MakeMount) -> None:
    """Readers ignore a manifest whose body names another node than its directory; fsck must
    not call the same store clean."""
    a, body = published_good(make_mount)
    entry = as_path(file_entry(body, "good/a.bin"), "impostor.bin")
    put_manifest(a.shared, "evil-impostor", 1, encode_manifest(fake_body("n0", body, [entry])))
    res = cli("ls", a.shared, "--files")
    assert "claims to be from node" in res.stderr and "impostor.bin" not in res.stdout
    rc, rep, _ = fsck(a.shared)
    assert rc == 1 and any("evil-impostor/" in p for p in rep["problems"]), (
        f"fsck exit {rc} for a manifest every reader rejects: {rep}")


def test_fsck_finds_an_object_published_twice(make_mount: MakeMount) -> None:
    """An object name in two places on SHARED (beside the batch directories and in one):
    readers take whichever they list last, so it must have one content; fsck said ok (a full
    replay used to publish second copies so)."""
    a, _body = published_good(make_mount)
    rc, rep, _ = fsck(a.shared)
    assert rc == 0, rep
    objs = sorted((a.shared / "ckptfs" / "objects" / "n0").rglob("*.seg"))
    dup = a.shared / "ckptfs" / "objects" / "n0" / f"b{'f' * 15}0-{'f' * 15}1"
    dup.mkdir()
    shutil.copyfile(objs[0], dup / objs[0].name)
    rc, rep, _ = fsck(a.shared)
    assert rc == 1 and any(f"n0/{objs[0].name[:16]}: published more than once" in p
                           for p in rep["problems"]), rep


def test_fsck_names_the_manifest_of_a_bad_extent(make_mount: MakeMount) -> None:
    """An extent pointing past the end of a good object is the fault of the manifest that holds
    it: the problem line must name that manifest (or its file), not only the good object."""
    a, body = published_good(make_mount)
    ext = file_entry(body, "good/a.bin")["extents"][0]
    far = [ext[0], ext[1], ext[2], ext[3] + FAR, ext[4], ext[5]]
    entry = as_path(file_entry(body, "good/a.bin"), "pos/x.bin", extents=[far])
    put_manifest(a.shared, "evil-pos", 1, encode_manifest(fake_body("evil-pos", body, [entry])))
    rc, rep, _ = fsck(a.shared)
    assert rc == 1, rep
    assert any("evil-pos" in p or "pos/x.bin" in p for p in rep["problems"]), (
        f"no problem names the manifest evil-pos or its file pos/x.bin: {rep['problems']}")


def check_mount_view(m: Mount, bad_data: dict[str, str]) -> None:
    top = set(os.listdir(m.mnt))
    assert not {"escape.bin", "impostor.bin", "trunc", "..", "nul\0name"} & top, top
    assert not (m.mnt / "r").exists() or not os.listdir(m.mnt / "r"), os.listdir(m.mnt / "r")
    assert not (m.mnt / "sym/lnk/pwned.bin").exists() or (m.mnt / "sym/lnk").is_symlink()
    for node, rel in bad_data.items():
        p = m.mnt / rel
        if not p.exists():
            continue  # ignoring it entirely is fine too
        with pytest.raises(OSError) as exc:
            data = p.read_bytes()
            pytest.fail(f"{m.root.name}: read of {rel} from {node} returned {len(data)} bytes "
                        f"(equal to the source: {data == GOOD['good/a.bin']})")
        check_errno(exc.value, errno.EIO)
    assert m.alive, m.log_tail()
    assert status(m)["corrupt_reads"] >= 0


# -- corrupt objects of a real node -----------------------------------------------------------


def corrupt_case(make_mount: MakeMount) -> tuple[Mount, Path, int]:
    m, body = published_good(make_mount)
    ext = file_entry(body, "good/a.bin")["extents"][0]
    return m, object_path(m.shared, ext[2]), payload_offset(ext)


def test_bit_flip_in_object_after_eviction_reads_eio(make_mount: MakeMount) -> None:
    m, obj, off = corrupt_case(make_mount)
    # the read before eviction has verified the record from the local copy
    assert (m.mnt / "good/a.bin").read_bytes() == GOOD["good/a.bin"]
    assert control(m, {"op": "evict", "all": True})["evicted"] >= 1
    flip_byte(obj, off)
    drop_caches()
    with pytest.raises(OSError) as exc:
        data = (m.mnt / "good/a.bin").read_bytes()
        diff = sum(x != y for x, y in zip(data, GOOD["good/a.bin"]))
        pytest.fail(f"read of a file whose object has a flipped bit returned {len(data)} bytes, "
                    f"{diff} of them wrong, instead of EIO")
    check_errno(exc.value, errno.EIO)
    assert status(m)["corrupt_reads"] >= 1
    # the other file in another record is unharmed
    assert (m.mnt / "good/sub/b.bin").read_bytes() == GOOD["good/sub/b.bin"]


def test_bit_flip_in_object_is_eio_on_a_fresh_node_and_in_fsck(make_mount: MakeMount,
                                                                tmp_path: Path) -> None:
    m, obj, off = corrupt_case(make_mount)
    flip_byte(obj, off)
    rc, rep, _ = fsck(m.shared)
    assert rc == 1 and any(obj.stem in p for p in rep["problems"]), rep
    res = cli("export", m.shared, "good", tmp_path / "out", check=False)
    assert "checksum" in assert_one_line_error(res, "export of a corrupt object")
    m.unmount()
    b = start_node(make_mount, "b", "n1", shared=m.shared)
    drop_caches()
    with pytest.raises(OSError) as exc:
        (b.mnt / "good/a.bin").read_bytes()
    check_errno(exc.value, errno.EIO)
    assert (b.mnt / "good/sub/b.bin").read_bytes() == GOOD["good/sub/b.bin"]
    assert b.alive


def test_truncated_object_is_reported_and_reads_eio(make_mount: MakeMount,
                                                    tmp_path: Path) -> None:
    m, obj, off = corrupt_case(make_mount)
    m.unmount()
    size = obj.stat().st_size
    os.truncate(obj, off)
    rc, rep, _ = fsck(m.shared, deep=False)
    assert rc == 1 and rep["problems"], rep
    assert all("\n" not in p for p in rep["problems"]), rep["problems"]
    res = cli("export", m.shared, "good", tmp_path / "out", check=False)
    assert_one_line_error(res, "export from a truncated object")
    b = start_node(make_mount, "b", "n1", shared=m.shared)
    with pytest.raises(OSError) as exc:
        (b.mnt / "good/a.bin").read_bytes()
    check_errno(exc.value, errno.EIO)
    assert b.alive and size > off


def test_gc_says_in_one_line_that_it_did_not_run_while_shared_is_gone(
        make_mount: MakeMount) -> None:
    """`ckptfs gc` while the shared filesystem is not mounted (SHARED looks empty): not
    "0 segments freed" and exit 0, but one error line; once SHARED is back it runs."""
    a = start_node(make_mount, "a", "n0")
    write_tree(a.mnt, {"step_1/x": blob("x", 300_000)})
    wait_published(a.mnt)
    store = a.shared / "ckptfs"
    store.rename(a.shared / "away")
    try:
        res = cli("gc", a.mnt, check=False)
        line = assert_one_line_error(res, "gc without SHARED")
        assert "did not run" in line and "FORMAT" in line, line
    finally:
        (a.shared / "away").rename(store)
    res = cli("gc", a.mnt)
    assert "segments freed" in res.stdout
    assert (a.mnt / "step_1" / "x").read_bytes() == blob("x", 300_000)


@pytest.mark.parametrize("damage", ["missing", "other-format", "newer-version"])
def test_readers_refuse_a_store_whose_format_file_is_missing_or_foreign(
        make_mount: MakeMount, tmp_path: Path, damage: str) -> None:
    """ls, export and fsck read FORMAT as a mount does: a store without it (daemons will
    not publish there) or of another format or a newer version is one error line, not
    "ok" or an export made by guessing."""
    a = start_node(make_mount, "a", "n0")
    write_tree(a.mnt, GOOD)
    wait_published(a.mnt)
    a.unmount()
    fmt_file = a.shared / "ckptfs" / "FORMAT"
    if damage == "missing":
        fmt_file.unlink()
    else:
        fmt_file.write_text(json.dumps({"format": "other"} if damage == "other-format"
                                       else {"format": "ckptfs-shared", "version": 2}))
    for args in (["fsck", a.shared], ["ls", a.shared], ["export", a.shared, "good",
                                                         tmp_path / "out"]):
        line = assert_one_line_error(cli(*args, check=False), f"{args[0]} ({damage})")
        assert "FORMAT" in line, line
