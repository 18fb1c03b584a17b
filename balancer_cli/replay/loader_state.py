"""The batch sampler's own state inside a torchdata ``StatefulDataLoader`` state (no torch needed).

``StatefulDataLoader.state_dict()`` nests the sampler's state among the loader's, in a layout
that depends on ``num_workers``; ``load_state_dict`` then requires the same ``num_workers`` (it
asserts inside torchdata otherwise). To resume with another number of workers, take the sampler's
part and give it to the new sampler, leaving the new loader's own state alone::

    state = loader.state_dict()                                     # saved with the checkpoint
    sampler = ManifestBatchSampler(manifest_dir, lengths=lengths_path)
    sampler.load_state_dict(sampler_state_from_loader(state))       # any num_workers now
    loader = StatefulDataLoader(dataset, batch_sampler=sampler, num_workers=3)  # no load_state_dict

The sampler's part is exact: torchdata snapshots the sampler as each batch is handed to the
training loop (not as workers prefetch), and the batches a snapshot is behind
(``_steps_since_snapshot``, with ``snapshot_every_n_steps > 1``) are added to ``batch_in_step``.
Only the sampler's state is kept: a dataset with a state of its own restores it itself.

Example:
    >>> replay_state = {"version": 2, "batch_in_step": 1}
    >>> sampler_state_from_loader({"_index_sampler_state": replay_state, "_num_yielded": 5})
    {'version': 2, 'batch_in_step': 1}
    >>> workers = {"_snapshot": {"_main_snapshot": {"_index_sampler_state": replay_state}}, "_steps_since_snapshot": 2}
    >>> sampler_state_from_loader(workers)
    {'version': 2, 'batch_in_step': 3}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from balancer_cli.errors import UsageError

__all__ = ["sampler_state_from_loader"]

# torchdata.stateful_dataloader.stateful_dataloader's keys (torchdata 0.8 to 0.11).
_SNAPSHOT, _MAIN_SNAPSHOT, _STEPS_SINCE = "_snapshot", "_main_snapshot", "_steps_since_snapshot"
_SAMPLER_STATE = "_index_sampler_state"


def sampler_state_from_loader(loader_state: Mapping[str, Any]) -> dict:
    """The batch sampler's state inside ``StatefulDataLoader.state_dict()``, whatever its ``num_workers``.

    Raises:
        UsageError: ``loader_state`` is not a ``StatefulDataLoader`` state, or its batch sampler
            saved none (it was not a ``ManifestBatchSampler``).
    """
    if _SNAPSHOT in loader_state:  # num_workers > 0: the main process's snapshot
        main = loader_state[_SNAPSHOT].get(_MAIN_SNAPSHOT) or {}
        state, ahead = main.get(_SAMPLER_STATE), int(loader_state.get(_STEPS_SINCE) or 0)
    elif _SAMPLER_STATE in loader_state:  # num_workers == 0
        state, ahead = loader_state[_SAMPLER_STATE], 0
    else:
        raise UsageError(f"not a StatefulDataLoader state (keys {sorted(loader_state)[:6]})",
                         fix="pass what StatefulDataLoader.state_dict() returned")
    if not isinstance(state, Mapping):
        raise UsageError("the loader's batch sampler saved no state",
                         fix="build the StatefulDataLoader with batch_sampler=ManifestBatchSampler(...)")
    state = dict(state)
    if ahead:
        state["batch_in_step"] = int(state["batch_in_step"]) + ahead
    return state
