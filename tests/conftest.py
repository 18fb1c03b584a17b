"""Shared pytest fixtures: paths to the real data beside the checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
SAMPLE_DATA = ROOT / "sample_data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (always present in CI); tests skip with a reason when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (it is always present in CI)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def internvl_lengths(shared_data: Path) -> list[Path]:
    """The four OmniBal/InternVL token-length JSON files, sorted by name."""
    return sorted((shared_data / "internvl-lengths").glob("*.json"))


@pytest.fixture(scope="session")
def ray_cluster():
    """One small local Ray cluster (2 CPUs, small object store, no dashboard) for the whole run.

    Started once and stopped at the end of the session: starting and stopping a cluster per
    module left the driver exposed to a dying raylet between modules. Ray is an extra, so tests
    using it skip cleanly when it is not installed (CI installs it). A module whose own
    functions must reach the workers registers itself with ``register_pickle_by_value``.
    """
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(address="local", num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False,
             log_to_driver=False, configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield ray
    ray.shutdown()
