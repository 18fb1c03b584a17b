"""`balancer scan` killed at random times (SIGKILL, SIGTERM): the output is the previous complete
file or absent, never a partial one; SIGTERM leaves no temporary file; no worker outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from balancer_cli.lengths import read_lengths

ITERATIONS = 3  # per signal

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds workers through /proc")


def _dataset(path: Path, n: int) -> None:
    rng = np.random.default_rng(3)
    with path.open("w") as handle:
        for i in range(n):
            words = " ".join(["word"] * int(rng.integers(5, 80)))
            record = {"image": "x.jpg", "width": int(rng.integers(64, 2000)), "height": int(rng.integers(64, 2000)),
                      "conversations": [{"from": "human", "value": f"<image>\n{words} {i}"},
                                        {"from": "gpt", "value": words}]}
            handle.write(json.dumps(record) + "\n")


def _scan(data: Path, out: Path, marker: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "balancer_cli", "scan", str(data), "-o", str(out), "--model", "qwen2-vl",
            "--tokenizer", "qwen2", "-j", "2", "--block-size", "200", "--quiet"]
    # The marker is inherited by every worker: it finds them after their parent is gone.
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "BALANCER_TEST_MARKER": marker})


def _processes_with(marker: str) -> list[int]:
    found = []
    needle = f"BALANCER_TEST_MARKER={marker}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _no_survivors(marker: str) -> bool:
    deadline = time.monotonic() + 30
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _processes_with(marker)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_scan_keeps_the_previous_output_and_leaves_no_workers(tmp_path, sig):
    data = tmp_path / "data.jsonl"
    _dataset(data, 3000)
    out = tmp_path / "lengths.parquet"
    marker = uuid.uuid4().hex
    started = time.perf_counter()
    first = _scan(data, out, marker)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    duration = time.perf_counter() - started
    reference = read_lengths(out).table
    rng = np.random.default_rng(int(sig))
    for _ in range(ITERATIONS):
        marker = uuid.uuid4().hex
        process = _scan(data, out, marker)
        time.sleep(float(rng.uniform(0.05, 1.0)) * duration)
        process.send_signal(sig)
        code = process.wait(timeout=300)
        stderr = process.stderr.read()
        assert _no_survivors(marker), f"workers outlived the scan killed with {sig!r}"
        if sig == signal.SIGTERM:
            assert code in (0, -signal.SIGTERM, 143), (code, stderr)
            if code == 143:
                assert stderr.strip().splitlines()[-1].startswith("Error: terminated"), stderr
            leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".lengths.parquet."))
            assert not leftovers, leftovers
        # written atomically: the file is always one complete run's output, equal to the first
        assert read_lengths(out).table.equals(reference)
