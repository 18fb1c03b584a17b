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
