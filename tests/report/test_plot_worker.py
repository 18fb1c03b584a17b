"""report.png drawn in a child process: the same bytes as in this process, and every failure falls back."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import balancer_cli.run as run
from balancer_cli.lengths import make_lengths_table, write_lengths
from balancer_cli.pack.config import PackConfig
from balancer_cli.report import plot_worker
from balancer_cli.report.plot import plot_report
from balancer_cli.report.plot_worker import PlotWorker, want_worker


def _loads(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"vision": rng.uniform(50, 100, (80, 4)), "llm": rng.uniform(900, 1100, (80, 4))}


def test_the_child_draws_the_same_png_as_this_process(tmp_path):
    ours, baseline = _loads(0), _loads(1)
    labels = {"ours_label": "ours (balanced)", "baseline_label": "random"}
    plot_report(tmp_path / "here.png", ours, baseline, **labels)
    with PlotWorker() as worker:
        assert worker._proc is not None  # a child really runs
        worker.plot(tmp_path / "child.png", ours, baseline, **labels)
    assert (tmp_path / "child.png").read_bytes() == (tmp_path / "here.png").read_bytes()


def test_a_figure_submitted_early_is_collected_from_the_child(tmp_path, monkeypatch):
    ours = _loads(4)
    labels = {"ours_label": "ours (balanced)", "baseline_label": None}
    plot_report(tmp_path / "here.png", ours, None, **labels)
    from balancer_cli.report import plot

    with PlotWorker() as worker:
        worker.submit(ours, None, **labels)
        worker.submit(_loads(5), None)  # only the first figure is sent
        monkeypatch.setattr(plot, "plot_report", lambda *a, **k: pytest.fail("drawn here, not in the child"))
        worker.plot(tmp_path / "child.png", {m: v.copy() for m, v in ours.items()}, None, **labels)
    assert (tmp_path / "child.png").read_bytes() == (tmp_path / "here.png").read_bytes()


def test_a_figure_other_than_the_submitted_one_is_drawn_here(tmp_path):
    ours, other = _loads(6), _loads(7)
    plot_report(tmp_path / "here.png", other, None, ours_label="x")
    with PlotWorker() as worker:
        worker.submit(ours, None, ours_label="x")
        proc = worker._proc
        worker.plot(tmp_path / "asked.png", other, None, ours_label="x")
    assert (tmp_path / "asked.png").read_bytes() == (tmp_path / "here.png").read_bytes()
    assert proc.poll() is not None  # the child drawing the unwanted figure was stopped


@pytest.mark.parametrize("failure", ["killed", "no interpreter", "exits 3", "hangs"])
def test_a_failing_child_falls_back_to_drawing_here(tmp_path, monkeypatch, failure):
    ours = _loads(2)
    plot_report(tmp_path / "here.png", ours, None)
    command = None
    if failure == "no interpreter":
        command = [str(tmp_path / "missing-python")]
    elif failure == "exits 3":
        command = [sys.executable, "-c", "import sys; sys.stdin.buffer.read(); sys.exit(3)"]
    elif failure == "hangs":
        command = [sys.executable, "-c", "import time; time.sleep(60)"]
        monkeypatch.setattr(plot_worker, "TIMEOUT_S", 0.5)
    worker = PlotWorker(command)
    assert (worker._proc is None) == (failure == "no interpreter")
    if failure == "killed":
        worker._proc.kill()
        worker._proc.wait()
    proc = worker._proc
    worker.plot(tmp_path / "fallback.png", ours, None)
    assert (tmp_path / "fallback.png").read_bytes() == (tmp_path / "here.png").read_bytes()
    assert proc is None or proc.poll() is not None  # no child left behind
    worker.close()  # nothing left to stop


def test_an_unused_child_is_stopped():
    worker = PlotWorker()
    proc = worker._proc
    worker.close()
    assert proc.poll() is not None


def test_want_worker_only_for_large_runs_in_a_fresh_process(monkeypatch):
    assert not want_worker(plot_worker.WORKER_MIN_SAMPLES - 1)
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)
    monkeypatch.setattr(plot_worker, "usable_cores", lambda: 2)
    assert want_worker(plot_worker.WORKER_MIN_SAMPLES)
    monkeypatch.setattr(plot_worker, "usable_cores", lambda: 1)
    assert not want_worker(plot_worker.WORKER_MIN_SAMPLES)
    monkeypatch.setitem(sys.modules, "matplotlib", sys)  # already imported: draw here at once
    monkeypatch.setattr(plot_worker, "usable_cores", lambda: 2)
    assert not want_worker(plot_worker.WORKER_MIN_SAMPLES)


@pytest.mark.parametrize("baselines", [(), ("random",)])
def test_pack_to_dir_with_the_worker_writes_the_same_folder(tmp_path, monkeypatch, baselines):
    """Without a baseline the figure is sent before the manifest is written; with one, after the report."""
    rng = np.random.default_rng(3)
    n = 600
    items = rng.integers(0, 5, n)
    lt = make_lengths_table(rng.integers(50, 600, n) + 256 * items, {"vision": (256 * items, items)})
    write_lengths(lt, tmp_path / "lengths.parquet")
    config = PackConfig(world_size=4)
    outs = {}
    for use in (False, True):
        monkeypatch.setattr(run, "want_worker", lambda num_samples, use=use: use)
        outs[use] = tmp_path / f"out-{use}"
        run.pack_to_dir([tmp_path / "lengths.parquet"], outs[use], config, baselines=baselines)
    for name in ("manifest.parquet", "report.json", "report.md", "report.png", "_COMMIT.json"):
        assert (outs[True] / name).read_bytes() == (outs[False] / name).read_bytes(), name


def test_pack_to_dir_starts_no_worker_under_a_memory_budget(tmp_path, monkeypatch):
    lt = make_lengths_table(np.arange(100, 140), {"vision": (np.full(40, 256), np.ones(40, int))})
    write_lengths(lt, tmp_path / "lengths.parquet")
    started = []
    monkeypatch.setattr(run, "want_worker", lambda num_samples: True)
    monkeypatch.setattr(run, "PlotWorker", lambda: started.append(1) or PlotWorker())
    for budget in (None, 1.0):
        run.pack_to_dir([tmp_path / "lengths.parquet"], tmp_path / f"out-{budget}", PackConfig(world_size=2),
                        baselines=(), memory_gb=budget)
    assert started == [1]  # the run without a budget only
    assert (tmp_path / "out-1.0" / "report.png").stat().st_size > 0
