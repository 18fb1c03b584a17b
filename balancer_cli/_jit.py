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

import contextlib
import importlib.util
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["HAVE_NUMBA", "njit", "prefetch", "warm_up"]

F = TypeVar("F", bound=Callable)

try:  # numba is a declared dependency; the fallback keeps the package importable without it.
    import numba as _numba

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is absent
    _numba = None
    HAVE_NUMBA = False


def _import_arraymath_without_blas_probe() -> None:
    """Import ``numba.np.arraymath`` (numba's CPU target loads it with the first kernel) without
    its import-time BLAS probe, where SciPy is installed.

    The probe (``_HAVE_BLAS = _check_blas()``) imports ``scipy.linalg.cython_blas``, which imports
    all of ``scipy.linalg`` (and NumPy's f2py): 0.15 s of every command that runs a kernel (a 1.2M
    pack takes ~3.6 s), for linear algebra no kernel here uses. With SciPy installed the probe's
    answer is known (True), so it is given without the import; numba's linear algebra still
    imports SciPy itself the first time a kernel that uses it compiles (``ensure_blas`` in
    ``numba.np.linalg`` is left as it was). Without SciPy, or on a numba whose modules differ,
    nothing is changed.
    """
    if "numba.np.arraymath" in sys.modules or importlib.util.find_spec("scipy") is None:
        return
    with contextlib.suppress(Exception):
        from numba.np import linalg

        probe = linalg.ensure_blas
        linalg.ensure_blas = lambda: None  # what arraymath binds for its probe at import
        try:
            import numba.np.arraymath  # noqa: F401
        finally:
            linalg.ensure_blas = probe


if HAVE_NUMBA:
    _import_arraymath_without_blas_probe()


def njit(func: F | None = None, *, inline: bool = False) -> F | Callable[[F], F]:
    """Compile ``func`` with numba when available, else return it unchanged.

    ``@njit(inline=True)`` marks a small helper that numba inlines into the kernels calling it
    (``inline="always"``): a call per inner-loop iteration then costs nothing (the random-partner
    pass's exchange bounds: 0.53 s a pass called, 0.42 s inlined, against 0.46 s without them).
    """
    if func is None:
        return lambda f: njit(f, inline=inline)
    if _numba is None:  # pragma: no cover
        return func
    return _numba.njit(cache=True, nogil=True, inline="always" if inline else "never")(func)


def warm_up(call: Callable[[], object]) -> threading.Thread | None:
    """Run ``call``, a cheap call of a compiled kernel, on a daemon thread, and return the thread
    (None without numba, where there is nothing to warm).

    A process's first kernel call builds numba's typing and target contexts, 0.2-0.3 s of Python,
    on whichever thread calls first. Started before a command reads its inputs, that work overlaps
    the read (pyarrow releases the GIL), and the main thread's first kernel finds the contexts
    built (or waits on numba's compile lock for them). Nothing else changes: an error is left to
    the kernel's first real call to raise.

    Example:
        >>> thread = warm_up(lambda: None)
        >>> thread is None or (thread.join() or not thread.is_alive())
        True
    """
    if _numba is None:  # pragma: no cover
        return None

    def run() -> None:
        with contextlib.suppress(Exception):
            call()

    thread = threading.Thread(target=run, name="balancer-jit-warm-up", daemon=True)
    thread.start()
    return thread


def prefetch(array, index) -> None:
    """Ask the CPU to start loading the cache line of element ``index`` of ``array``'s flat
    (C-order) buffer; in plain Python (numba absent, or a kernel's ``py_func``) it does nothing.

    Kernels whose reads jump across tables larger than the cache (a random partner group's sums
    and rows) issue it a few iterations ahead, so several loads are in flight at once instead of
    one after the other: the random-partner pass at 1.2M rows takes 0.41 s instead of 0.96 s.
    Only a hint: it never faults, even past the end, and changes no result.
    """
    return None


def _register_prefetch() -> None:
    """Compile :func:`prefetch` to LLVM's prefetch intrinsic inside numba kernels."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic, overload

    @intrinsic
    def _prefetch_line(typingctx, array, index):
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            flat = context.cast(builder, args[1], signature.args[1], types.intp)
            i8p, i32 = ir.PointerType(ir.IntType(8)), ir.IntType(32)
            # The unmangled name: LLVM's auto-upgrade gives it the pointer suffix its version
            # wants (checked with LLVM 14 and 22). Read access, high locality, data cache.
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch")
            builder.call(fn, [builder.bitcast(builder.gep(data, [flat]), i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(array, index), codegen

    @overload(prefetch, jit_options={"cache": True})
    def _prefetch_compiled(array, index):
        if isinstance(array, types.Array) and isinstance(index, types.Integer):
            return lambda array, index: _prefetch_line(array, index)
        return None


if _numba is not None:
    _register_prefetch()
