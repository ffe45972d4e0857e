"""Crash test: writers work through the mount while the daemon is SIGKILLed at random moments;
after each remount every operation a writer saw return must be there, byte-exact (LevelDB's
fault_injection_test, with a process kill instead of dropped page cache: nothing the daemon
acknowledged may live only in its memory).

Each writer (tests/sigkill_writer.py) owns a directory and journals, outside the mount, each
operation before it starts and after it returns. The expected state of a directory is its
journal's acknowledged operations replayed by `apply_op`; the one operation a writer had in
flight when the daemon died may be found applied, not applied, or (for data) part-written.

Long run: CKPTFS_SIGKILL_ROUNDS=500 CKPTFS_SIGKILL_SEED=<n> pytest -m slow tests/test_sigkill.py
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mounting import MakeMount, Mount, wait_for
from sigkill_writer import apply_op, touched

WRITER = Path(__file__).with_name("sigkill_writer.py")
DEAD_ERRNOS = {"ENOTCONN", "ECONNABORTED", "EIO"}  # what a request to a killed daemon gets


def read_journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def count_done(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        try:
            total += p.read_bytes().count(b'"ev": "done"')
        except FileNotFoundError:
            pass
    return total


def actual_state(d: Path) -> dict[str, bytes]:
    return {name: (d / name).read_bytes() for name in os.listdir(d)}


def describe(content: bytes | None) -> str:
    return "absent" if content is None else f"{len(content)} bytes"


def partial_write_ok(got: bytes, old: bytes | None, new: bytes | None) -> bool:
    """Could `got` be `old` with a data write towards `new` interrupted part-way? Every byte is
    the old or the new value (zero where old had none) and the size lies between the two."""
    if new is None:
        return False
    base = old or b""
    lo, hi = sorted((len(base), len(new)))
    if not lo <= len(got) <= hi:
        return False
    for i in range(0, len(got), 4096):
        g = got[i : i + 4096]
        o = base[i : i + 4096].ljust(len(g), b"\0")
        n = new[i : i + 4096].ljust(len(g), b"\0")
        if g != o and g != n and any(a != b and a != c for a, b, c in zip(g, o, n)):
            return False
    return True


def in_flight_consistent(op: dict[str, Any], actual: dict[str, bytes],
                         before: dict[str, bytes], after: dict[str, bytes]) -> bool:
    """Is what an interrupted op left one of the states it may pass through?"""
    kind, name = op["op"], op["name"]
    got = actual.get(name)
    if kind == "rename":  # atomic: both names old, or both new
        pair = (actual.get(name), actual.get(op["dst"]))
        return pair in ((before.get(name), before.get(op["dst"])),
                        (after.get(name), after.get(op["dst"])))
    if kind in ("unlink", "truncate"):
        return got in (before.get(name), after.get(name))
    if kind in ("create", "pwrite", "append"):
        return got == before.get(name) or (
            got is not None and partial_write_ok(got, before.get(name), after.get(name)))
    assert kind == "replace"
    tmp = actual.get(op["tmp"])
    if got == after[name] and got != before.get(name):
        return tmp is None  # the rename happened, so the temp file is gone
    if got != before.get(name):
        return False
    # Not renamed yet: the temp file is the old leftover, or being (re)written from empty.
    return tmp == before.get(op["tmp"]) or (
        tmp is not None and partial_write_ok(tmp, b"", after[name]))


class WriterModel:
    """Expected contents of one writer's directory, carried across rounds."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state: dict[str, bytes] = {}
        self.acked = 0

    def check_round(self, journal: list[dict[str, Any]], actual: dict[str, bytes],
                    kill_time: float) -> list[str]:
        problems: list[str] = []
        pending: dict[str, Any] | None = None
        synced: dict[str, bool] = {}
        for rec in journal:
            if rec["ev"] == "begin":
                assert pending is None
                pending = rec["op"]
            elif rec["ev"] == "done":
                assert pending is not None
                apply_op(self.state, pending)
                for n in touched(pending):
                    synced[n] = bool(pending.get("sync")) or pending["op"] == "replace"
                self.acked += 1
                pending = None
            elif rec["ev"] == "error":
                if rec["errno"] not in DEAD_ERRNOS:
                    problems.append(f"{self.name} op {rec['k']} {pending}: {rec['errno']}")
                elif rec["t"] < kill_time:
                    problems.append(f"{self.name} op {rec['k']} {pending}: {rec['errno']} "
                                    f"{kill_time - rec['t']:.3f}s before the daemon was killed")
        expected = self.state
        maybe = dict(expected)
        in_flight: list[str] = []
        if pending is not None:
            apply_op(maybe, pending)
            in_flight = touched(pending)
        for name in sorted(set(expected) | set(actual)):
            got, old = actual.get(name), expected.get(name)
            if got == old or name in in_flight:
                continue
            detail = ""
            if got is not None and old is not None:
                diff = next((i for i, (a, b) in enumerate(zip(got, old)) if a != b), None)
                detail = f", first difference at byte {diff}" if diff is not None else ""
            problems.append(
                f"{self.name}/{name}: expected {describe(old)}, found {describe(got)}{detail}"
                f" (its last acknowledged op {'was' if synced.get(name) else 'was not'} fsynced)"
            )
        if pending is not None and not in_flight_consistent(pending, actual, expected, maybe):
            found = ", ".join(f"{n}: expected {describe(expected.get(n))} or "
                              f"{describe(maybe.get(n))}, found {describe(actual.get(n))}"
                              for n in in_flight)
            problems.append(f"{self.name}: interrupted op {json.dumps(pending)} left an "
                            f"impossible state: {found}")
        if pending is not None:
            # Whatever the interrupted op left is the new truth for the next round.
            for name in in_flight:
                if name in actual:
                    self.state[name] = actual[name]
                else:
                    self.state.pop(name, None)
        return problems


def run_rounds(m: Mount, tmp_path: Path, seed: int, rounds: int, writers: int) -> None:
    rng = random.Random(seed)
    models = [WriterModel(f"w{i}") for i in range(writers)]
    for model in models:
        os.mkdir(m.mnt / model.name)
    journals = tmp_path / "journals"
    journals.mkdir()
    total_ops = 0
    for rnd in range(rounds):
        paths = [journals / f"r{rnd}-{model.name}.jsonl" for model in models]
        procs = [
            subprocess.Popen(
                [sys.executable, str(WRITER), str(m.mnt / model.name), str(path),
                 str(rng.getrandbits(32)), "1000000"],
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for model, path in zip(models, paths)
        ]
        try:
            # Kill after a random number of acknowledged ops: sometimes almost at once.
            target = rng.randint(0, 10) if rng.random() < 0.25 else rng.randint(10, 250)
            def progressed(paths: list[Path] = paths, target: int = target,
                           procs: list[subprocess.Popen[bytes]] = procs) -> bool:
                return count_done(paths) >= target or any(p.poll() is not None for p in procs)

            wait_for(progressed, 60, f"round {rnd}: writers to complete {target} operations")
            kill_time = time.monotonic()
            m.kill()
            for p in procs:
                _, err = p.communicate(timeout=30)
                assert p.returncode == 0, f"writer crashed:\n{err.decode()}"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        killed_log = m.log_tail()
        m.remount()  # drops the dead mount (fusermount3 -uz), starts a new daemon
        problems = []
        for model, path in zip(models, paths):
            problems += model.check_round(read_journal(path), actual_state(m.mnt / model.name),
                                          kill_time)
        total_ops += count_done(paths)
        assert not problems, (
            f"seed {seed}, round {rnd} (kill after ~{target} ops; journals in {journals}):\n  "
            + "\n  ".join(problems) + f"\n--- killed daemon's log ---\n{killed_log}"
        )
    # Finally a clean unmount: the state must survive that too.
    m.unmount()
    m.start()
    for model in models:
        assert actual_state(m.mnt / model.name) == model.state, model.name
    assert total_ops > rounds, "writers barely ran: the test tested nothing"


def test_checker_catches_lost_and_torn_ops() -> None:
    """The checker itself, without a mount: it must be able to fail."""
    create = {"op": "create", "name": "f0", "n": 10_000, "dseed": 1}
    rename = {"op": "rename", "name": "f0", "dst": "f1"}
    data = apply_and_get(create)["f0"]
    journal = [{"k": 0, "ev": "begin", "op": create}, {"k": 0, "ev": "done"}]

    def check(actual: dict[str, bytes], tail: list[dict[str, Any]] | None = None) -> list[str]:
        return WriterModel("w").check_round(journal + (tail or []), actual, kill_time=0.0)

    assert check({"f0": data}) == []
    assert check({}) != []  # acknowledged create lost
    assert check({"f0": data[:-1]}) != []  # torn
    assert check({"f0": data[:5000] + bytes(5000)}) != []  # a hole where data was acked
    pending = [{"k": 1, "ev": "begin", "op": rename},
               {"k": 1, "ev": "error", "errno": "ENOTCONN", "t": 1.0}]
    assert check({"f0": data}, pending) == []  # rename not applied
    assert check({"f1": data}, pending) == []  # rename applied
    assert check({}, pending) != []  # neither: data lost
    assert check({"f0": data, "f1": data}, pending) != []
    pwrite = {"op": "pwrite", "name": "f0", "off": 8192, "n": 8192, "dseed": 2}
    after = apply_and_get(create, pwrite)["f0"]
    pending = [{"k": 1, "ev": "begin", "op": pwrite},
               {"k": 1, "ev": "error", "errno": "ECONNABORTED", "t": 1.0}]
    assert check({"f0": after}, pending) == []
    assert check({"f0": after[:12288]}, pending) == []  # part-written: first chunk only
    assert check({"f0": after[:8192] + bytes(4096)}, pending) != []  # zeros over old data
    early = [{"k": 1, "ev": "begin", "op": pwrite},
             {"k": 1, "ev": "error", "errno": "EIO", "t": -1.0}]
    assert check({"f0": data}, early) != []  # an error while the daemon was still alive
    wrong = [{"k": 1, "ev": "begin", "op": pwrite},
             {"k": 1, "ev": "error", "errno": "ENOSPC", "t": 1.0}]
    assert check({"f0": data}, wrong) != []


def apply_and_get(*ops: dict[str, Any]) -> dict[str, bytes]:
    state: dict[str, bytes] = {}
    for op in ops:
        apply_op(state, op)
    return state


@pytest.mark.timeout(240)
def test_sigkill_acknowledged_ops_survive(make_mount: MakeMount, tmp_path: Path) -> None:
    m = make_mount(segment_size="1M", extra_args=["--seal-idle", "0.2"])
    run_rounds(m, tmp_path, seed=20240, rounds=20, writers=3)


@pytest.mark.slow
@pytest.mark.timeout(6 * 3600)
def test_sigkill_long(make_mount: MakeMount, tmp_path: Path) -> None:
    seed = int(os.environ.get("CKPTFS_SIGKILL_SEED", str(int(time.time()))))
    rounds = int(os.environ.get("CKPTFS_SIGKILL_ROUNDS", "300"))
    print(f"sigkill: seed {seed}, {rounds} rounds")
    m = make_mount(segment_size="1M", extra_args=["--seal-idle", "0.2"])
    run_rounds(m, tmp_path, seed, rounds, writers=4)
