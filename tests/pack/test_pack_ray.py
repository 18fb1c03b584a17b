"""``balancer pack --engine ray``: the local engine's bytes, resumable, failing windows reported.

The session's small local Ray cluster (``ray_cluster`` in tests/conftest.py) serves these tests;
Ray is an extra, so everything skips
cleanly when it is not installed (CI installs it).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

from balancer_cli.errors import InputError, UsageError
from balancer_cli.lengths import make_lengths_table, write_lengths
from balancer_cli.pack.config import PackConfig
from balancer_cli.pack.windows import WindowTask
from balancer_cli.run import pack_to_dir

FILES = ("manifest.parquet", "dropped.parquet", "report.json")


@pytest.fixture(scope="module")
def ray_session(ray_cluster):
    return ray_cluster


@pytest.fixture(scope="module")
def lengths(tmp_path_factory) -> str:
    rng = np.random.default_rng(4)
    n = 5000
    source = rng.choice(["chart", "doc", "text"], n, p=[0.4, 0.4, 0.2])
    items = np.where(source == "text", 0, rng.integers(1, 7, n))
    tokens = 256 * items + rng.integers(20, 900, n)
    error = [None] * n
    error[11] = "missing_file: d.jsonl:12: x.png not found"
    path = tmp_path_factory.mktemp("ray_pack") / "lengths.parquet"
    write_lengths(make_lengths_table(tokens, {"vision": (256 * items, items)}, source=source, error=error), path)
    return str(path)


CONFIG = PackConfig(world_size=4, micro_batches=2, epochs=2, window_samples=1200)


def _pack(lengths, out, **kwargs):
    return pack_to_dir([lengths], out, CONFIG, baselines=("random",), **kwargs)


@pytest.mark.parametrize("first_window", [False, True])
def test_ray_writes_the_local_engines_bytes(ray_session, lengths, tmp_path, monkeypatch, first_window):
    """Also where the pick is checked on its first window, which the driver packs and both engines reuse."""
    from balancer_cli.pack import pipeline

    if first_window:
        monkeypatch.setattr(pipeline, "CHECK_MAX_SAMPLES", 0)
    _pack(lengths, tmp_path / "local")
    _pack(lengths, tmp_path / "ray", engine="ray")
    for name in FILES:
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "ray" / name).read_bytes(), name
    assert not (tmp_path / "ray.parts").exists()  # removed once the manifest is written


def test_a_rerun_resumes_from_the_kept_windows_and_repacks_a_corrupt_one(ray_session, lengths, tmp_path):
    from balancer_cli.pack.engines.ray import shard_path

    _pack(lengths, tmp_path / "first", engine="ray", keep_parts=True)
    parts = tmp_path / "first.parts"
    shards = sorted(parts.glob("balanced-*.npz"))
    assert len(shards) == 2 * 5  # 2 epochs x ceil(4999 / 1200) windows
    shards[0].write_bytes(b"not an npz")  # a shard cut short: packed again
    os.rename(parts, tmp_path / "second.parts")
    lines, done = [], []
    _pack(lengths, tmp_path / "second", engine="ray", notify=lines.append, on_window=lambda d, t: done.append((d, t)))
    assert lines and "9 of 10 windows already packed" in lines[0]
    assert done == [(i, 10) for i in range(1, 11)]  # the 9 kept windows, then the one packed again
    for name in FILES:
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name
    task = WindowTask(packer="balanced", config=CONFIG, caps_K=np.array([1]), bounds_K=np.array([1]), epoch=0, window=0)
    assert shard_path(parts, task).name == "balanced-e0000-w000000.npz"


def test_a_window_that_keeps_failing_is_reported_and_others_are_kept(ray_session, lengths, tmp_path):
    parts = tmp_path / "out.parts"
    blocker = parts / "balanced-e0001-w000002.npz"  # a directory where the shard goes: OSError each try
    blocker.mkdir(parents=True)
    (blocker / "keep").write_text("x")
    (parts / ".balancer-parts").write_text("")  # the marker: a parts folder is ours to reuse
    with pytest.raises(InputError, match=r"1 of 10 pack windows failed after 3 retries \(epoch 1 window 2: .*"
                                         r"fix: rerun the same command"):
        _pack(lengths, tmp_path / "out", engine="ray")
    assert len(list(parts.glob("balanced-*.npz"))) == 10  # 9 shards + the blocker
    assert not (tmp_path / "out").exists()


def test_data_errors_are_raised_as_the_local_engine_raises_them(ray_session, lengths, tmp_path):
    too_wide = PackConfig(world_size=8192, window_samples=1200, caps=(("vision", 40), ("llm", 12000)))
    with pytest.raises(UsageError) as local:
        pack_to_dir([lengths], tmp_path / "a", too_wide, baselines=())
    with pytest.raises(UsageError) as remote:
        pack_to_dir([lengths], tmp_path / "b", too_wide, baselines=(), engine="ray")
    assert str(local.value) == str(remote.value)


def test_ray_options_without_the_ray_engine_are_usage_errors(lengths, tmp_path):
    with pytest.raises(UsageError, match="applies to the ray engine only"):
        _pack(lengths, tmp_path / "x", ray_address="auto")
    with pytest.raises(UsageError, match="applies to the ray engine only"):
        _pack(lengths, tmp_path / "y", keep_parts=True)


def test_a_local_cluster_prints_no_token_notice_and_leaves_the_environment(tmp_path):
    """Ray prints that a new local cluster uses token authentication on every start; the session
    keeps that notice off the command's output, keeps Ray's mode while the cluster runs and
    restores ``RAY_AUTH_MODE`` (which Ray sets for the process) afterwards."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("ray")
    script = tmp_path / "session.py"
    script.write_text(textwrap.dedent("""
        import os
        from types import SimpleNamespace
        from balancer_cli._ray import ray_session

        with ray_session(SimpleNamespace(address=None, num_cpus=1, object_store_bytes=80 * 2**20)):
            print("inside", os.environ.get("RAY_AUTH_MODE"))
        print("after", os.environ.get("RAY_AUTH_MODE"))
    """))
    import balancer_cli

    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["PYTHONPATH"] = str(Path(balancer_cli.__file__).resolve().parents[1])  # this tree, installed or not
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240, check=False)
    assert run.returncode == 0, run.stderr
    assert "Token authentication" not in run.stderr + run.stdout
    assert "inside token" in run.stdout and "after None" in run.stdout


def test_an_address_where_nothing_answers_is_refused_before_ray_waits_for_it():
    """Ray waits ~14 minutes for a cluster's GCS before it gives up: a mistyped ``--ray-address``
    hung ``balancer pack`` that long. The session first checks that something answers there."""
    import socket

    from balancer_cli._ray import _check_reachable

    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(InputError, match=f"nothing answers at 127.0.0.1:{port}"):
            _check_reachable(address)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        _check_reachable(f"127.0.0.1:{server.getsockname()[1]}")  # something answers: Ray's turn
    _check_reachable("auto")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="lists processes through /proc")
def test_a_stopped_session_ends_its_processes_that_ignore_sigterm():
    """After a SIGTERM, Ray's dashboard and runtime-env agents outlived their stopped raylet by
    ~60 s (they ignore SIGTERM). The session lists its Ray processes before it stops and ends
    those left: SIGTERM, then SIGKILL after a grace period; none is left a zombie."""
    import subprocess
    import sys
    import time

    from balancer_cli._ray import _end_processes, _ray_descendants

    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code, "ray::DashboardAgent"], stdout=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not Ray's: left alone
    try:
        child.stdout.readline()  # SIGTERM is ignored from here on
        # (a Ray session of the test run may have processes of its own: only ours are looked at)
        listed = [(pid, start) for pid, start in _ray_descendants() if pid in (child.pid, other.pid)]
        assert [pid for pid, _ in listed] == [child.pid]
        started = time.monotonic()
        _end_processes(listed, grace_s=0.5)
        assert time.monotonic() - started < 5
        assert not Path(f"/proc/{child.pid}").exists()  # killed and reaped
        assert other.poll() is None
    finally:
        for process in (child, other):
            process.kill()
            process.wait()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds processes through /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_ray_pack_ended_by_a_signal_leaves_no_ray_process(lengths, tmp_path, sig):
    """``balancer pack --engine ray`` stopped by SIGTERM exits 143 with one line, and no process
    of its local cluster (they inherit a marker in their environment) outlives it by more than a
    few seconds (Ray's own agents lingered ~60 s). Killed by SIGKILL, it runs no code: its reaper
    (balancer_cli._reaper) ends the cluster (Ray's processes stayed ~60-100 s)."""
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from balancer_cli._ray import _cmdline

    pytest.importorskip("ray")
    marker = uuid.uuid4().hex
    needle = f"BALANCER_TEST_MARKER={marker}".encode()

    def marked() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    args = [sys.executable, "-m", "balancer_cli", "pack", lengths, "-o", str(tmp_path / "out"), "--engine", "ray",
            "--dp", "4", "--micro-batches", "2", "--window-samples", "600", "--epochs", "4", "--quiet"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "BALANCER_TEST_MARKER": marker})
    deadline = time.monotonic() + 120
    while not any(b"ray::_place" in _cmdline(pid) for pid in marked()) and process.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)  # until a window's task runs: a SIGTERM then interrupted Ray's shutdown
    process.send_signal(getattr(signal, sig))
    code = process.wait(timeout=120)
    stderr = process.stderr.read()
    assert code in (0, 143, -signal.SIGKILL), stderr
    if code == 143:
        assert stderr.strip().splitlines()[-1].startswith("Error: terminated"), stderr
    deadline = time.monotonic() + 8
    while marked() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = marked()
    for pid in left:  # not to burden the other tests when it fails
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} Ray processes outlived the pack"
