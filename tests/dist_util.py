"""Helpers for real multi-process torch.distributed tests (gloo on CPU)."""

from __future__ import annotations

import socket


def free_tcp_init_method() -> str:
    """``tcp://127.0.0.1:PORT`` on a port that was free a moment ago.

    A TCP store is used rather than a shared file: the file store's shutdown races when ranks leave
    at different times, which aborts a rank now and then on a loaded machine.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def shutdown(dist) -> None:
    """Leave together: a barrier first, so no rank tears gloo down while another still talks."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def _exit_after(rank: int, worker, *args) -> None:
    """Run ``worker(rank, *args)``, then leave with ``os._exit``: in the interpreter's normal teardown
    a gloo worker thread that frees a finished collective's tensors (which takes the GIL) now and
    then aborts the process ("terminate called without an active exception") after all the work
    succeeded (``examples/train_tiny_vlm.py`` holds its work handles instead)."""
    import os
    import sys
    import traceback

    try:
        worker(rank, *args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn`` whose workers exit without the teardown race (see :func:`_exit_after`)."""
    import torch.multiprocessing as mp

    mp.spawn(_exit_after, args=(worker, *args), nprocs=nprocs, join=True)
