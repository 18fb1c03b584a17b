"""Replaying a manifest, torch-free: the reader, the cursor, elastic re-planning, post-balancing.

- :mod:`~balancer_cli.replay.reader`: lazy, validated access to a manifest's steps.
- :mod:`~balancer_cli.replay.cursor`: :class:`~balancer_cli.replay.cursor.ManifestReplay`, one
  rank's resumable pass over the manifest; :mod:`~balancer_cli.replay.epoch_plan` plans its
  epochs, :mod:`~balancer_cli.replay.samples` holds what it takes from the lengths table.
- :mod:`~balancer_cli.replay.state`: what a resume state records and checks;
  :mod:`~balancer_cli.replay.loader_state` takes it out of a torchdata loader's state.
- :mod:`~balancer_cli.replay.elastic`, :mod:`~balancer_cli.replay.replan`,
  :mod:`~balancer_cli.replay.group_plan` (and their kernels): replay at another world size;
  :mod:`~balancer_cli.replay.plan_cache` keeps those plans beside the manifest.
- :mod:`~balancer_cli.replay.post_balance`: per-phase rebalancing of a step (OrchMLLM).

The PyTorch adapters (batch sampler, all-to-all dispatch) are in :mod:`balancer_cli.runtime`.

Example:
    >>> import subprocess, sys
    >>> code = "import balancer_cli.replay.cursor, sys; print('torch' in sys.modules)"
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    'False'
"""

__all__: list[str] = []
