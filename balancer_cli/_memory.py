"""Freed memory: reused within a phase of a large run, given back to the OS between phases.

Arrow's allocator keeps pages it freed (reading a 10M-sample lengths file leaves ~340 MiB of
them), and glibc's malloc keeps freed heap blocks below its adaptive mmap threshold (up to 32 MiB
each, so numpy's per-window arrays stay resident after a window). Both count towards a run's
peak, so the pipeline hands them back once a phase's arrays are gone
(:func:`release_freed_memory`; only memory already freed is returned).

Within a phase the opposite is what costs: by default malloc hands the top of its heap back
whenever more than twice the mmap threshold lies free there, and every page handed back is
zeroed by the kernel when the next array touches it. A 10M pack allocates and frees the same
window-sized arrays for each of its 13 windows: 0.55M page faults, 12% of its CPU in the
kernel's page clearing. :func:`keep_freed_memory` (the command line calls it once; a library
leaves its host's allocator alone) makes malloc keep such blocks for reuse: 0.16M faults and
2.6 s less CPU at the same peak, since the phases' explicit release still returns them.

It also gives malloc one arena for every thread. With one per thread (glibc's default), the
blocks that the refinement's two threads free stay in their own arenas, where the main thread's
next window cannot reuse them: a 10M pack at ``--memory-gb 1`` peaked at 910-933 MiB in 10 of 12
runs and at 971 and 975 MiB (1.02 GB: over the issue's 1 GB) in 2, as the threads happened to
allocate; with one arena at 906-921 MiB in 10 of 10, at the same CPU (the kernels allocate
outside their loops, so the shared arena's lock is rarely taken).

numpy asks the kernel to back every array of 4 MiB or more with 2 MiB pages
(``madvise(MADV_HUGEPAGE)``). Where transparent huge pages are on for such requests (Linux's
default ``madvise`` mode) a 10M pack then spent 1.1-2.2 s in the kernel (630 huge-page faults a
run) for no user time saved; :func:`use_small_pages` (the command line calls it with
:func:`keep_freed_memory`) turns the advice off: 0.7-0.8 s in the kernel, at the same peak.

Example:
    >>> release_freed_memory()
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory", "release_freed_memory", "use_small_pages"]

# glibc's mallopt parameters (malloc.h) and its largest mmap threshold on 64-bit platforms
# (DEFAULT_MMAP_THRESHOLD_MAX): blocks above it are always mapped and unmapped on their own.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_MMAP_THRESHOLD_MAX = 32 * 2**20
_INT_MAX = 2**31 - 1


def _libc_function(name: str):
    """A glibc function by name (None elsewhere: musl, macOS, Windows)."""
    lib = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks of up to 32 MiB for reuse instead of handing them
    to the kernel (which zeroes them again on the next touch), in one arena that every thread
    shares (module docstring); for a process that runs one job.

    Returns:
        Whether the allocator took the settings (False off glibc).

    Example:
        >>> isinstance(keep_freed_memory(), bool)
        True
    """
    if _MALLOPT is None:
        return False
    # A fixed threshold at glibc's maximum: the adaptive one starts at 128 KiB and only rises
    # as mapped blocks are freed. An explicit value also stops the adaptive trim threshold.
    kept = bool(_MALLOPT(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(_MALLOPT(_M_TRIM_THRESHOLD, _INT_MAX))
    return bool(_MALLOPT(_M_ARENA_MAX, 1)) and kept


def use_small_pages() -> bool:
    """Stop numpy from advising the kernel to back large arrays with huge pages (module
    docstring); for a process that runs one job.

    Returns:
        Whether numpy took the setting (False where it has no such switch).

    Example:
        >>> isinstance(use_small_pages(), bool)
        True
    """
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    switch = getattr(multiarray, "_set_madvise_hugepage", None)
    if switch is None:
        return False
    switch(False)
    return True


def release_freed_memory() -> None:
    """Return Arrow's and malloc's freed pages to the OS (cheap: a few ms)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
