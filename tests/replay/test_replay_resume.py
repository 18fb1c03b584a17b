"""Resume safety: a state saved anywhere resumes on any world size with every sample exactly once,
and a state whose rest depends on a lengths table or caps it was not saved with is refused.

Every rank is simulated in one process (no torch); the torchdata worker-count changes are in
tests/runtime/test_runtime_loader_state.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_util import pack_random, random_lengths
from resume_util import epoch_samples, flat, run, with_caps

from balancer_cli.errors import ManifestError
from balancer_cli.manifest import open_manifest
from balancer_cli.replay.cursor import ManifestReplay


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    lengths = random_lengths(150, seed=4)
    src = pack_random(tmp_path_factory.mktemp("src"), num_samples=150, world_size=2, micro_batches=2, epochs=2,
                      seed=4, rows_per_row_group=16)
    return with_caps(src, tmp_path_factory.mktemp("capped"), lengths, {"vision": 14, "llm": 3000}), lengths


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 4), micro=st.integers(1, 3), saved=st.integers(1, 8), new=st.integers(1, 8),
       cut=st.floats(0, 1), epoch=st.integers(0, 2), use_lengths=st.booleans(), seed=st.integers(0, 10**4))
def test_a_state_saved_anywhere_resumes_on_any_world_size_exactly_once(
        tmp_path_factory, world, micro, saved, new, cut, epoch, use_lengths, seed):
    lengths = random_lengths(50 + seed % 70, seed=seed)
    manifest = pack_random(tmp_path_factory.mktemp("h"), num_samples=lengths.num_samples, world_size=world,
                           micro_batches=micro, epochs=1 + seed % 2, drop=seed % 3, seed=seed,
                           rows_per_row_group=8, lengths=lengths if use_lengths else None)
    kwargs = {"lengths": lengths} if use_lengths else {}
    total = len(ManifestReplay(manifest, rank=0, world_size=saved, epoch=epoch, **kwargs))
    cut_batches = round(cut * total)  # any batch of any step, the very last included
    before, state = run(manifest, saved, cut=cut_batches, epoch=epoch, **kwargs)
    after, _ = run(manifest, new, state=state, epoch=epoch, **kwargs)
    assert np.array_equal(np.sort(flat(before) + flat(after)), epoch_samples(manifest, epoch))


@settings(max_examples=15, deadline=None)
@given(worlds=st.lists(st.one_of(st.just(2), st.integers(1, 8)), min_size=3, max_size=4),  # 2: the packed one
       cuts=st.lists(st.floats(0, 1), min_size=3, max_size=3))
def test_chained_resumes_on_changing_world_sizes_with_caps(capped, worlds, cuts):
    manifest, lengths = capped
    seen, state = [], None
    for world, cut in zip(worlds, cuts[:len(worlds) - 1] + [None]):
        left = len(ManifestReplay(manifest, rank=0, world_size=world, lengths=lengths))
        if state is not None:
            probe = ManifestReplay(manifest, rank=0, world_size=world, lengths=lengths)
            probe.load_state_dict(state)
            left = len(probe)
        taken, state = run(manifest, world, state=state, cut=None if cut is None else round(cut * left),
                           lengths=lengths)
        seen += flat(taken)
    assert np.array_equal(np.sort(seen), epoch_samples(manifest, 0))


def test_the_last_step_resumes_on_more_ranks_than_samples_left(tmp_path):
    # 2 ranks x 1 micro-batch, interrupted inside the epoch's last step: what is left goes to the
    # first ranks, one sample each; the other ranks get one empty batch, so every rank still
    # runs the same number of batches.
    manifest = pack_random(tmp_path / "m", num_samples=40, world_size=2, micro_batches=1, drop=0, seed=1)
    full, _ = run(manifest, 3)
    before, state = run(manifest, 3, cut=len(full[0]) - 1)
    left = len(flat(full)) - len(flat(before))
    assert 0 < left < 8
    for new in (left, left + 1, 8):
        after, end = run(manifest, new, state=state)
        assert [len(batches) for batches in after] == [1] * new
        assert [len(batches[0]) for batches in after] == [1] * left + [0] * (new - left)
        assert np.array_equal(np.sort(flat(before) + flat(after)), epoch_samples(manifest, 0))
        replay = ManifestReplay(manifest, rank=new - 1, world_size=new)
        replay.load_state_dict(state)
        assert replay.batches_in_step(replay.next_step) == 1 and len(replay) == 1
        assert (end["position"], end["batch_in_step"], end["head"]) == (open_manifest(manifest).epoch_num_steps[0], 0,
                                                                        None)


def test_an_epoch_with_fewer_samples_than_ranks_gives_empty_batches(tmp_path):
    manifest = pack_random(tmp_path / "m", num_samples=8, world_size=1, micro_batches=1, drop=0, seed=2)
    per_rank, _ = run(manifest, 12)
    assert [len(b[0]) for b in per_rank] == [1] * 8 + [0] * 4
    assert np.array_equal(np.sort(flat(per_rank)), epoch_samples(manifest, 0))


def test_a_state_at_the_end_of_an_epoch_resumes_at_its_end_on_any_world_size(capped):
    manifest, lengths = capped
    _, state = run(manifest, 3, lengths=lengths)
    for new in (1, 2, 5, 8):
        after, again = run(manifest, new, state=state, lengths=lengths)
        assert flat(after) == [] and again["position"] == state["position"]


def test_batches_past_the_step_roll_forward(capped):
    manifest, lengths = capped
    full, _ = run(manifest, 3, lengths=lengths)
    for cut, extra in ((0, 5), (2, 4), (4, 3), (1, 7)):
        _, state = run(manifest, 3, cut=cut, lengths=lengths)
        ahead = dict(state, batch_in_step=state["batch_in_step"] + extra)
        rest, _ = run(manifest, 3, state=ahead, lengths=lengths)
        assert rest == [batches[cut + extra:] for batches in full]
    with pytest.raises(ManifestError, match="past the .* batches left in epoch 0"):
        run(manifest, 3, state=dict(state, batch_in_step=len(full[0]) + 1), lengths=lengths)


def test_another_lengths_table_is_refused_inside_an_elastic_step(capped):
    manifest, lengths = capped
    _, state = run(manifest, 3, cut=3, lengths=lengths)  # inside a step of the elastic replay on 3 ranks
    assert state["lengths"] == lengths.fingerprint and state["caps"] == {"llm": 3000, "vision": 14}
    assert state["batch_in_step"] > 0
    for world in (3, 5):
        with pytest.raises(ManifestError) as error:
            ManifestReplay(manifest, rank=0, world_size=world).load_state_dict(state)
        text = str(error.value)
        assert f"with lengths table {lengths.fingerprint[:12]}, caps llm 3000, vision 14" in text
        assert "this replay has no lengths table" in text and "fix: pass the same lengths" in text
    text_only = random_lengths(150, seed=4)
    text_only = type(text_only)(text_only.table.drop_columns(["vision_tokens", "vision_items"]), {}, "f" * 32)
    src = pack_random(open_manifest(manifest).path.parent.parent / "nofp", num_samples=150, world_size=2,
                      micro_batches=2, seed=4)  # records no lengths fingerprint: any table passes
    _, other = run(src, 3, cut=3, lengths=lengths)
    with pytest.raises(ManifestError, match="this replay has lengths table ffffffffffff"):
        ManifestReplay(src, rank=0, world_size=3, lengths=text_only).load_state_dict(other)


@pytest.mark.parametrize("saved_world", [2, 3])
def test_a_step_boundary_or_a_packed_step_resumes_with_or_without_lengths(capped, saved_world):
    # At a step boundary, or inside a step replayed as packed (2 ranks here), the samples still
    # due do not depend on the lengths table: the resume is accepted and exact either way.
    manifest, lengths = capped
    k = ManifestReplay(manifest, rank=0, world_size=saved_world).batches_per_step
    cuts = (k, 2 * k, k + 1) if saved_world == 2 else (k, 2 * k)
    for cut in cuts:
        before, state = run(manifest, saved_world, cut=cut, lengths=lengths)
        for new in (2, 3, 4):
            after, _ = run(manifest, new, state=state)
            assert np.array_equal(np.sort(flat(before) + flat(after)), epoch_samples(manifest, 0))


def test_version_1_states_load_and_unknown_versions_are_refused(capped):
    manifest, lengths = capped
    full, _ = run(manifest, 3, lengths=lengths)
    _, state = run(manifest, 3, cut=3, lengths=lengths)
    v1 = {k: v for k, v in state.items() if k not in ("lengths", "caps")}
    v1["version"] = 1
    rest, _ = run(manifest, 3, state=v1, lengths=lengths)
    assert rest == [batches[3:] for batches in full]
    with pytest.raises(ManifestError, match="sampler state version 3, this balancer_cli reads versions 1, 2"):
        run(manifest, 3, state=dict(state, version=3), lengths=lengths)


@pytest.mark.parametrize("change, message", [
    ({"step": -1}, "step -1, not an integer >= 0"),
    ({"world_size": 0}, "world_size 0, not an integer >= 1"),
    ({"position": "3"}, "position '3', not an integer"),
    ({"head": [1]}, "head \\[1\\], not a state"),
    ({"position": 10**6}, "position 1000000, past the .* steps of epoch 0"),
])
def test_a_corrupt_state_is_a_clear_error(capped, change, message):
    manifest, lengths = capped
    _, state = run(manifest, 2, cut=1, lengths=lengths)
    with pytest.raises(ManifestError, match=message):
        ManifestReplay(manifest, rank=0, world_size=2, lengths=lengths).load_state_dict(dict(state, **change))
    missing = {k: v for k, v in state.items() if k != "batch_in_step"}
    with pytest.raises(ManifestError, match="lacks batch_in_step"):
        ManifestReplay(manifest, rank=0, world_size=2).load_state_dict(missing)


def test_a_state_at_the_end_of_an_epoch_survives_an_iterator_dropped_unstarted(capped):
    # torch's multi-worker DataLoader calls iter() on its batch sampler twice and drops the first
    # iterator unstarted: the loaded end of the epoch must still yield nothing, then the next
    # pass replays the epoch from its start.
    manifest, lengths = capped
    full, state = run(manifest, 2, lengths=lengths)
    replay = ManifestReplay(manifest, rank=0, world_size=2, lengths=lengths)
    replay.load_state_dict(state)
    iter(replay)
    assert list(replay) == [] and list(replay) == full[0]


@pytest.mark.parametrize("use_lengths", [True, False])
def test_back_at_the_packed_world_size_only_the_interrupted_step_is_replanned(capped, use_lengths):
    # 2 ranks x 2 micro-batches packed; interrupted on 1 rank, resumed on 2: the rest of that step
    # is re-planned, the steps after it replay as packed, so a state saved inside one of them
    # (no head, the packed world size) means what it says when it resumes on 1 or 3 ranks.
    manifest, lengths = capped
    kwargs = {"lengths": lengths} if use_lengths else {}
    packed, _ = run(manifest, 2, **kwargs)
    before, state = run(manifest, 1, cut=22, **kwargs)  # 4 batches per step on 1 rank: inside step 5
    assert (state["step"], state["batch_in_step"]) == (5, 2)
    replays = [ManifestReplay(manifest, rank=r, world_size=2, **kwargs) for r in range(2)]
    for replay in replays:
        replay.load_state_dict(state)
    its, middle = [iter(replay) for replay in replays], [[], []]
    while True:  # one batch at a time, until inside a step after the re-planned one
        for rank, it in enumerate(its):
            middle[rank].append(next(it))
        inside = replays[0].state_dict()
        if inside["head"] is None and inside["batch_in_step"] == 1:
            break
    position = inside["position"]  # the manifest step (epoch 0 is in manifest order)
    assert position > 5 and [batches[-1] for batches in middle] == [p[2 * position] for p in packed]
    for new in (1, 3):
        after, _ = run(manifest, new, state=inside, **kwargs)
        got = flat(before) + flat(middle) + flat(after)
        assert np.array_equal(np.sort(got), epoch_samples(manifest, 0))
