"""Fixtures for real-mount tests: see mounting.py for the Mount helper."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from mounting import (
    LIVE_DAEMONS,
    STOP_TIMEOUT,
    MakeMount,
    Mount,
    fuse_mounts_under,
    lazy_unmount_all_under,
)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # Keep each phase's report on the item so fixture teardown can tell whether the test failed.
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep


def _test_failed(request: pytest.FixtureRequest) -> bool:
    for when in ("setup", "call"):
        rep = getattr(request.node, "rep_" + when, None)
        if rep is not None and rep.failed:
            return True
    # No call report at all means the test never ran to completion (e.g. interrupted).
    return getattr(request.node, "rep_call", None) is None


@pytest.fixture
def make_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MakeMount]:
    """A factory of started mounts, `make_mount(name="m", extra_args=(), segment_size=None,
    start=True)`; every mount it made is torn down after the test, whatever happened.

    A teardown that needed the failure path (busy mount, dead daemon, non-zero exit after a clean
    unmount) fails a test that had passed; after a failed test it only cleans up.
    """
    made: list[Mount] = []

    def factory(
        name: str = "m",
        extra_args: tuple[str, ...] | list[str] = (),
        segment_size: str | None = None,
        start: bool = True,
    ) -> Mount:
        m = Mount(tmp_path / name, extra_args, segment_size=segment_size)
        made.append(m)
        if start:
            m.start()
        return m

    yield factory

    problems: list[str] = []
    for m in reversed(made):
        problems += [f"{m.root.name}: {p}" for p in m.teardown()]
    left = fuse_mounts_under(tmp_path)
    if left:
        lazy_unmount_all_under(tmp_path)
        problems.append(f"fuse mounts left under {tmp_path}: {left}")
    if problems and not _test_failed(request):
        logs = "\n".join(f"--- {m.root.name} daemon log ---\n{m.log_tail()}" for m in made)
        pytest.fail("mount teardown needed the failure path:\n  " + "\n  ".join(problems)
                    + "\n" + logs, pytrace=False)


@pytest.fixture
def mount(make_mount: MakeMount) -> Mount:
    """One started ckptfs mount with default options."""
    return make_mount()


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Last line of defence: lazily unmount any FUSE mount left under basetemp and kill any
    daemon this run started that is still alive, then complain loudly."""
    yield
    base = tmp_path_factory.getbasetemp()
    leaked = lazy_unmount_all_under(base)
    killed = []
    for pid, proc in list(LIVE_DAEMONS.items()):
        if proc.poll() is None:
            os.kill(pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT)
            killed.append(pid)
        LIVE_DAEMONS.pop(pid, None)
    if leaked or killed:
        msg = f"leaked fuse mounts {leaked} and daemons {killed} cleaned up at session end"
        print(msg, file=sys.stderr)
        pytest.fail(msg, pytrace=False)
