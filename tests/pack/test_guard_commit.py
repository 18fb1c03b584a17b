"""committed_folder: temporary folders removed on failure and on SIGTERM; the previous output kept."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from balancer_cli.cli._common import Terminated, _sigterm_raises
from balancer_cli.commit import (
    COMMIT_FILE,
    check_replaceable,
    committed_folder,
    read_commit,
)
from balancer_cli.errors import InputError


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_failure_and_sigterm_remove_the_temporary_folder_and_keep_the_old_output(tmp_path):
    out = tmp_path / "out"
    with committed_folder(out) as tmp:
        (tmp / "manifest.parquet").write_text("v1")
    with pytest.raises(ValueError), committed_folder(out) as tmp:
        (tmp / "manifest.parquet").write_text("v2")
        raise ValueError("a bug half way")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), _sigterm_raises(), committed_folder(out) as tmp:
        (tmp / "manifest.parquet").write_text("v3")
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises right after this call returns
        time.sleep(5)  # not reached
    assert _names(tmp_path) == ["out"] and (out / "manifest.parquet").read_text() == "v1"
    assert signal.getsignal(signal.SIGTERM) == before  # the command's handler is uninstalled
    with committed_folder(out) as tmp:
        (tmp / "manifest.parquet").write_text("v4")
    assert _names(tmp_path) == ["out"] and _names(out) == [COMMIT_FILE, "manifest.parquet"]
    assert (out / "manifest.parquet").read_text() == "v4" and set(read_commit(out)["files"]) == {"manifest.parquet"}


def test_only_empty_or_committed_clean_folders_are_replaceable(tmp_path):
    check_replaceable(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty")
    (tmp_path / "empty" / "x").write_text("x")
    with pytest.raises(InputError, match="not written by balancer"):
        check_replaceable(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file, not a folder"):
        check_replaceable(tmp_path / "file")


def test_a_link_to_an_output_folder_stays_a_link(tmp_path):
    real = tmp_path / "real"
    with committed_folder(real) as tmp:
        (tmp / "manifest.parquet").write_text("v1")
    (tmp_path / "link").symlink_to(real)
    with committed_folder(tmp_path / "link") as tmp:
        (tmp / "manifest.parquet").write_text("v2")
    assert (tmp_path / "link").is_symlink() and (real / "manifest.parquet").read_text() == "v2"
    assert _names(tmp_path) == ["link", "real"]


def test_a_folder_with_the_replays_plans_is_ours_to_replace(tmp_path):
    """The replay writes elastic-plans/ beside a committed manifest; packing into the folder again
    replaces it (the plans belong to the old manifest), while any other extra file is refused."""
    from balancer_cli.commit import PLANS_DIR
    from balancer_cli.lengths import make_lengths_table, write_lengths
    from balancer_cli.pack.config import PackConfig
    from balancer_cli.run import pack_to_dir

    lengths = tmp_path / "lengths.parquet"
    write_lengths(make_lengths_table(np.arange(40, 140)), lengths)
    out = tmp_path / "out"
    pack_to_dir([lengths], out, PackConfig(world_size=2), baselines=())
    (out / PLANS_DIR).mkdir()
    (out / PLANS_DIR / "R3-abc.npy").write_bytes(b"plan")
    check_replaceable(out)
    pack_to_dir([lengths], out, PackConfig(world_size=2, seed=1), baselines=())
    assert not (out / PLANS_DIR).exists()
    (out / PLANS_DIR).mkdir()
    (out / PLANS_DIR / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="did not write"):
        check_replaceable(out)


def _dead_pid():
    """A PID no process has any more (a child that has exited and been reaped)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_runs_temporary_folder_is_removed_by_the_next_run(tmp_path):
    """Only folders named for this host by a process that is gone, holding plain files, are deleted."""
    from balancer_cli._fsutil import remove_dead_temporaries, temporary_prefix

    out = tmp_path / "out"
    prefix = temporary_prefix(out)

    def folder(name, *, subfolder=False):
        path = tmp_path / name
        path.mkdir()
        (path / "manifest.parquet").write_bytes(b"half written")
        if subfolder:
            (path / "mine").mkdir()
        return path

    dead = folder(f"{prefix}{_dead_pid()}-x1")
    live = folder(f"{prefix}{os.getppid()}-x2")  # pytest's parent: alive
    holding = folder(f"{prefix}{_dead_pid()}-x3", subfolder=True)
    host = prefix.split("-")[-2]
    other_host = folder(f".out.tmp-{'0' * 8 if host != '0' * 8 else 'f' * 8}-{_dead_pid()}-x4")
    older = folder(".out.tmp-abcdefgh")  # an older version's name: no PID to check
    other_out = folder(f"{temporary_prefix(tmp_path / 'other')}{_dead_pid()}-x5")
    with committed_folder(out) as tmp:
        (tmp / "manifest.parquet").write_text("v1")
    assert not dead.exists()
    assert all(p.exists() for p in (live, holding, other_host, older, other_out))
    assert remove_dead_temporaries(out, folder=True) == []


def test_pack_after_a_sigkill_leaves_only_the_output(tmp_path):
    """A pack killed (SIGKILL) while writing its folder leaves the temporary folder; the next pack
    into the same output removes it and writes the same files as an uninterrupted run."""
    import subprocess
    import sys

    from balancer_cli.lengths import make_lengths_table, write_lengths

    rng = np.random.default_rng(0)
    items = rng.integers(0, 6, 300)
    lengths = tmp_path / "lengths.parquet"
    write_lengths(make_lengths_table(items * 256 + rng.integers(30, 400, 300), {"vision": (items * 256, items)}),
                  lengths)
    args = ["pack", str(lengths), "--dp", "2", "--baselines", "none"]
    stalled = ("import sys, time, balancer_cli.report.build as b\n"
               "b.write_report = lambda *a, **k: time.sleep(600)\n"  # stall once the folder exists
               "from balancer_cli.cli import main\nsys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", stalled, *args, "-o", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".out.tmp-*/manifest.parquet")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before writing"
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
    assert len(list(tmp_path.glob(".out.tmp-*"))) == 1 and not (tmp_path / "out").exists()
    for out in ("out", "ref"):
        done = subprocess.run([sys.executable, "-m", "balancer_cli", *args, "-o", str(tmp_path / out)],
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
    assert _names(tmp_path) == ["lengths.parquet", "out", "ref"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.suffix == ".parquet"} == \
        {p.name: p.read_bytes() for p in (tmp_path / "ref").iterdir() if p.suffix == ".parquet"}


def test_a_killed_reports_temporary_inside_the_folder_does_not_block_replacing_it(tmp_path):
    """``balancer report OUT`` killed mid-write leaves ``.report.json.tmp-...`` inside OUT: the next
    pack into OUT replaces the folder with it; a live run's or another name's is still foreign."""
    from balancer_cli._fsutil import temporary_prefix

    out = tmp_path / "out"
    with committed_folder(out) as tmp:
        (tmp / "report.json").write_text("{}")
    dead = out / f"{temporary_prefix(out / 'report.json')}{_dead_pid()}-a.tmp"
    dead.write_text("half")
    check_replaceable(out)
    for name in (f"{temporary_prefix(out / 'report.json')}{os.getppid()}-b.tmp",
                 f"{temporary_prefix(out / 'notes.txt')}{_dead_pid()}-c.tmp"):
        (out / name).write_text("x")
        with pytest.raises(InputError, match="did not write"):
            check_replaceable(out)
        (out / name).unlink()
    with committed_folder(out) as tmp:
        (tmp / "report.json").write_text("{1}")
    assert _names(out) == [COMMIT_FILE, "report.json"] and _names(tmp_path) == ["out"]
