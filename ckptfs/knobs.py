"""Tuning knobs read from the environment (`CKPTFS_*`, docs/operations.md): a malformed value
is ignored with one warning line, never a traceback. They are read at import time, by every
command: a typo in a service's environment file must not stop `ckptfs umount` from working."""

from __future__ import annotations

import os
import sys


def number(name: str, default: int | float, unit: str, minimum: int | float = 0
           ) -> int | float:
    """The environment's `name` as a number of default's type (in `unit`), at least
    `minimum`; otherwise the default, with a warning on stderr."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    kind = type(default)
    try:
        value = kind(raw)
    except ValueError:
        pass
    else:
        if value >= minimum:
            return value
    whole = "a whole number" if kind is int else "a number"
    print(f"ckptfs: warning: ignoring {name}={raw!r}: not {whole} of {unit} of at least "
          f"{minimum}; using {default}", file=sys.stderr)
    return default
