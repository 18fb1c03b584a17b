"""`balancer pack` killed at random times (SIGKILL, SIGTERM): every later reader either accepts a
complete, valid output or refuses it with one line; SIGTERM leaves no temporary folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from balancer_cli.cli import main
from balancer_cli.commit import read_commit, verify_commit
from balancer_cli.errors import ManifestError
from balancer_cli.lengths import make_lengths_table, write_lengths
from balancer_cli.replay.reader import ManifestReader

ITERATIONS = 3  # per signal


def _pack(lengths: Path, out: Path, seed: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "balancer_cli", "pack", str(lengths), "--dp", "2", "--max-llm-tokens", "3000",
            "--max-vision-items", "10", "--baselines", "random", "--seed", str(seed), "-o", str(out), "--quiet"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _check_readers(out: Path) -> str:
    """'accepted' or 'refused'; anything else (a traceback, a mix of runs) fails the test."""
    if not out.exists():
        return "refused"
    result = CliRunner().invoke(main, ["report", str(out), "--baselines", "none"])
    try:
        reader = ManifestReader(out)
    except ManifestError as error:
        reader_ok, reader_error = False, str(error)
    else:
        reader_ok, reader_error = True, ""
        assert len(reader.step_groups(0)) == 2
    if result.exit_code == 0:
        assert reader_ok, reader_error
        record = read_commit(out)
        verify_commit(out, names=sorted(record["files"]), full=True)  # a complete folder of one run
        return "accepted"
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert not reader_ok and "fix:" in reader_error
    return "refused"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_pack_leaves_a_valid_or_refused_output(tmp_path, sig):
    rng = np.random.default_rng(11 + int(sig))
    items = rng.integers(0, 6, 3000)
    lengths = tmp_path / "lengths.parquet"
    write_lengths(make_lengths_table(items * 256 + rng.integers(30, 400, 3000), {"vision": (items * 256, items)}),
                  lengths)
    out = tmp_path / "out"
    started = time.perf_counter()
    first = _pack(lengths, out, seed=0)
    assert first.wait(timeout=120) == 0, first.stderr.read()
    duration = time.perf_counter() - started
    assert _check_readers(out) == "accepted"
    outcomes = []
    for seed in range(1, ITERATIONS + 1):
        process = _pack(lengths, out, seed=seed)
        time.sleep(float(rng.uniform(0.05, 1.0)) * duration)
        process.send_signal(sig)
        code = process.wait(timeout=120)
        stderr = process.stderr.read()
        if sig == signal.SIGTERM:
            # finished, killed before the handler was installed, or unwound through `finally`
            assert code in (0, -signal.SIGTERM, 143), (code, stderr)
            if code == 143:
                # the last line (a loaded machine may print a library's warning before it)
                assert stderr.strip().splitlines()[-1] == "Error: terminated; no output was written", stderr
                assert "Traceback" not in stderr, stderr
            leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out."))
            assert not leftovers, leftovers
        outcomes.append((code, _check_readers(out)))
    # the previous output is replaced atomically: killing a run never loses it
    assert all(state == "accepted" for _, state in outcomes), outcomes
