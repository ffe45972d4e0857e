"""ckptfs: a checkpoint filesystem.

Writes land as append-only records in log segments on local NVMe, an LMDB index maps files to
extents, and sealed segments drain to a shared store as a few big immutable objects.
"""

__version__ = "0.1.0"

from ckptfs.api import CkptfsError, status, wait  # noqa: E402

__all__ = ["wait", "status", "CkptfsError", "__version__"]
