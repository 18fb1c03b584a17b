"""The local scan engine: blocks measured in a pool of worker processes on this machine.

:func:`run_blocks` measures at most ``2 * jobs`` blocks at a time (so memory does not grow with the
dataset) and yields them in block order; small scans are measured in this process, where starting
workers would cost more than it saves.

Example:
    >>> import json, pathlib, tempfile
    >>> from balancer_cli.scan.blocks import iter_blocks
    >>> from balancer_cli.scan.measure import ScanConfig
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
    >>> _ = p.write_text(json.dumps({"text": "hello"}) + "\\n")
    >>> [table.num_rows for _, table in run_blocks(iter_blocks([str(p)]), ScanConfig(), jobs=1)]
    [1]
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import pyarrow as pa

from balancer_cli._procs import die_with_parent, terminate_workers
from balancer_cli.scan.blocks import RecordBlock
from balancer_cli.scan.measure import ScanConfig, measure_job, unwrap_job

__all__ = ["run_blocks"]

# Below this many records in total, measuring in this process beats starting worker processes.
_MIN_POOL_RECORDS = 4096


def _start_method() -> str:
    """``fork`` where available: workers start in milliseconds, and scans from notebooks or
    ``python -`` work (``spawn`` re-imports ``__main__``). All workers fork when the pool starts,
    before this process has measured or decoded anything; only ``spawn`` exists elsewhere."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() and sys.platform == "linux" else "spawn"


def run_blocks(blocks: Iterator[RecordBlock], config: ScanConfig, jobs: int) -> Iterator[tuple[RecordBlock, pa.Table]]:
    """Measure ``blocks`` in ``jobs`` worker processes; yield ``(block, table)`` in block order.

    Raises:
        SampleError: with ``config.strict``, the first bad sample in sample order.
    """
    head = list(itertools.islice(blocks, jobs + 2))
    blocks = itertools.chain(head, blocks)
    small = len(head) <= jobs + 1 and sum(b.num_records for b in head) < _MIN_POOL_RECORDS
    if jobs <= 1 or len(head) < 2 or small:  # starting workers would cost more than it saves
        for block in blocks:
            yield block, unwrap_job(measure_job(block, config))
        return
    context = multiprocessing.get_context(_start_method())
    pending: collections.deque[tuple[RecordBlock, Future]] = collections.deque()
    # Workers die with the scan (a SIGKILLed parent leaves no orphans) and stop at once on an error.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        try:
            for block in blocks:
                pending.append((block, pool.submit(measure_job, block, config)))
                while len(pending) >= 2 * jobs:
                    done_block, future = pending.popleft()
                    yield done_block, unwrap_job(future.result())
            while pending:
                done_block, future = pending.popleft()
                yield done_block, unwrap_job(future.result())
        except BaseException:
            for _, future in pending:
                future.cancel()
            terminate_workers(pool)
            raise
