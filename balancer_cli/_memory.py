"""Give freed memory back to the operating system between the phases of a large run.

Arrow's allocator keeps pages it freed (reading a 10M-sample lengths file leaves ~340 MiB of
them), and glibc's malloc keeps freed heap blocks below its adaptive mmap threshold (up to 32 MiB
each, so numpy's per-window arrays stay resident after a window). Both count towards a run's
peak, so the pipeline hands them back once a phase's arrays are gone. Only memory already freed
is returned; nothing changes the allocators' behaviour.

Example:
    >>> release_freed_memory()
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["release_freed_memory"]


def _libc_trim():
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def release_freed_memory() -> None:
    """Return Arrow's and malloc's freed pages to the OS (cheap: a few ms)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
