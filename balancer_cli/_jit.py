"""Optional numba compilation, shared by every kernel module.

Kernels are plain Python functions over numpy arrays. With numba importable, :func:`njit`
compiles them (``cache=True`` so the compile cost is paid once per environment, ``nogil=True``
so threads can run them side by side); without it they run as Python with identical results
(the same arithmetic in the same order), only slower. numba is an accelerator, never a
behaviour change.

Example (in a kernel module, a file: numba caches by source file):

    @njit
    def total(values):
        s = 0
        for v in values:
            s += v
        return s
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["HAVE_NUMBA", "njit"]

F = TypeVar("F", bound=Callable)

try:  # numba is a declared dependency; the fallback keeps the package importable without it.
    import numba as _numba

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is absent
    _numba = None
    HAVE_NUMBA = False


def njit(func: F) -> F:
    """Compile ``func`` with numba when available, else return it unchanged."""
    if _numba is None:  # pragma: no cover
        return func
    return _numba.njit(cache=True, nogil=True)(func)
