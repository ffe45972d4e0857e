"""A writer process for test_sigkill.py, and the model that replays its journal.

    python sigkill_writer.py DIR JOURNAL SEED MAX_OPS

The writer owns DIR (flat, regular files only) and performs random self-contained operations on
it. Around each one it appends JSON lines to JOURNAL, a file outside the mount:
    {"k": 3, "ev": "begin", "op": {...}}   before the operation starts
    {"k": 3, "ev": "done"}                 after it returned: the filesystem acknowledged it
    {"k": 3, "ev": "error", "errno": "ENOTCONN", "t": <CLOCK_MONOTONIC>}   and the writer stops
All data is a function of the op (`dseed`, `n`), so `apply_op` recomputes the expected state.
"""

from __future__ import annotations

import errno
import json
import os
import random
import sys
import time
from typing import Any

NAMES = [f"f{i}" for i in range(8)]
MAX_FILE = 3 << 20


def data(dseed: int, n: int) -> bytes:
    return random.Random(dseed).randbytes(n)


def splice(old: bytes, off: int, new: bytes) -> bytes:
    if len(old) < off:
        old = old + bytes(off - len(old))
    return old[:off] + new + old[off + len(new) :]


def apply_op(state: dict[str, bytes], op: dict[str, Any]) -> None:
    """The effect of one acknowledged operation on {name: content}."""
    kind, name = op["op"], op["name"]
    if kind == "create":
        state[name] = data(op["dseed"], op["n"])
    elif kind == "pwrite":
        state[name] = splice(state[name], op["off"], data(op["dseed"], op["n"]))
    elif kind == "append":
        state[name] = state[name] + data(op["dseed"], op["n"])
    elif kind == "truncate":
        old = state[name]
        state[name] = old[: op["size"]] + bytes(max(0, op["size"] - len(old)))
    elif kind == "rename":
        state[op["dst"]] = state.pop(name)
    elif kind == "unlink":
        del state[name]
    elif kind == "replace":
        state.pop(op["tmp"], None)  # a leftover temp file is truncated, rewritten, renamed
        state[name] = data(op["dseed"], op["n"])
    else:
        raise ValueError(kind)


def touched(op: dict[str, Any]) -> list[str]:
    """Names an operation may change (an interrupted one may leave any of them in between)."""
    names = [op["name"]]
    if op["op"] == "rename":
        names.append(op["dst"])
    if op["op"] == "replace":
        names.append(op["tmp"])
    return names


def choose(rng: random.Random, sizes: dict[str, int]) -> dict[str, Any]:
    existing = sorted(sizes)
    free = [n for n in NAMES if n not in sizes]
    weights = {"create": 15 if free else 0, "pwrite": 30, "append": 15, "truncate": 10,
               "rename": 10, "unlink": 8, "replace": 12}
    if not existing:
        weights = {"create": 1}
    kind = rng.choices(list(weights), list(weights.values()))[0]
    r = rng.random()
    n = rng.randint(1, 4096) if r < 0.4 else rng.randint(4096, 64 << 10) if r < 0.9 else \
        rng.randint(64 << 10, 512 << 10)
    dseed = rng.getrandbits(48)
    sync = rng.random() < 0.2
    if kind == "create":
        return {"op": kind, "name": rng.choice(free), "n": n, "dseed": dseed, "sync": sync}
    name = rng.choice(existing)
    size = sizes[name]
    if kind == "pwrite":
        off = rng.randint(0, size + (64 << 10)) if rng.random() < 0.95 else size + (1 << 20)
        if off + n > MAX_FILE:
            off = rng.randint(0, max(0, size - n))
        return {"op": kind, "name": name, "off": off, "n": n, "dseed": dseed, "sync": sync}
    if kind == "append":
        if size + n > MAX_FILE:
            return {"op": "truncate", "name": name, "size": rng.randint(0, size)}
        return {"op": kind, "name": name, "n": n, "dseed": dseed, "sync": sync}
    if kind == "truncate":
        return {"op": kind, "name": name, "size": rng.randint(0, min(MAX_FILE, size + 100_000))}
    if kind == "rename":
        return {"op": kind, "name": name, "dst": rng.choice(NAMES)}
    if kind == "unlink":
        return {"op": kind, "name": name}
    return {"op": "replace", "name": name, "tmp": ".tmp-" + name, "n": n, "dseed": dseed}


def perform(d: str, op: dict[str, Any]) -> None:
    kind, path = op["op"], os.path.join(d, op["name"])

    def finish(fd: int) -> None:
        if op.get("sync"):
            os.fsync(fd)
        os.close(fd)

    if kind == "create":
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, data(op["dseed"], op["n"]))
        finish(fd)
    elif kind == "pwrite":
        fd = os.open(path, os.O_WRONLY)
        os.pwrite(fd, data(op["dseed"], op["n"]), op["off"])
        finish(fd)
    elif kind == "append":
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.write(fd, data(op["dseed"], op["n"]))
        finish(fd)
    elif kind == "truncate":
        os.truncate(path, op["size"])
    elif kind == "rename":
        os.rename(path, os.path.join(d, op["dst"]))
    elif kind == "unlink":
        os.unlink(path)
    elif kind == "replace":  # the safe-save idiom: temp, fsync, rename over
        tmp = os.path.join(d, op["tmp"])
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        os.write(fd, data(op["dseed"], op["n"]))
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, path)
    else:
        raise ValueError(kind)


def main() -> int:
    d, journal, seed, max_ops = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    jfd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(**rec: Any) -> None:
        os.write(jfd, (json.dumps(rec) + "\n").encode())

    try:
        sizes = {name: os.stat(os.path.join(d, name)).st_size for name in os.listdir(d)}
    except OSError as e:
        log(k=-1, ev="error", errno=errno.errorcode.get(e.errno or 0, str(e.errno)),
            t=time.monotonic())
        return 0
    for k in range(max_ops):
        op = choose(rng, sizes)
        log(k=k, ev="begin", op=op)
        try:
            perform(d, op)
        except OSError as e:
            log(k=k, ev="error", errno=errno.errorcode.get(e.errno or 0, str(e.errno)),
                t=time.monotonic())
            return 0
        log(k=k, ev="done")
        if op["op"] == "rename":
            sizes[op["dst"]] = sizes.pop(op["name"])
        elif op["op"] == "unlink":
            del sizes[op["name"]]
        elif op["op"] == "truncate":
            sizes[op["name"]] = op["size"]
        elif op["op"] in ("create", "replace"):
            sizes[op["name"]] = op["n"]
            sizes.pop(op.get("tmp"), None)
        elif op["op"] == "append":
            sizes[op["name"]] += op["n"]
        elif op["op"] == "pwrite":
            sizes[op["name"]] = max(sizes[op["name"]], op["off"] + op["n"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
