"""ManifestReplay: exact replay, conservation, epochs, resume by seeking, validation, step tokens.

Every rank is simulated in one process, without torch; the PyTorch sampler over this replay is
tested in tests/runtime/test_runtime_sampler.py, the real multi-process job in test_runtime_dist.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from replay_util import pack_random, random_lengths, simulate

from balancer_cli.errors import ManifestError, UsageError
from balancer_cli.manifest import open_manifest
from balancer_cli.replay.cursor import ManifestReplay
from balancer_cli.replay.reader import ManifestReader

R, M = 4, 2


@pytest.fixture(scope="module")
def lengths():
    return random_lengths(300, seed=1, loss_tokens=True)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory, lengths):
    return pack_random(tmp_path_factory.mktemp("m"), num_samples=300, world_size=R, micro_batches=M, epochs=2,
                       lengths=lengths, extra=True)


def epoch_rows(manifest, epoch):
    m = open_manifest(manifest)
    starts = np.concatenate([[0], np.cumsum(m.epoch_num_steps)])
    return m.read_steps(int(starts[epoch]), int(starts[epoch + 1]))


def expected_native(manifest, epoch, rank):
    rows = epoch_rows(manifest, epoch)
    keep = rows.rank == rank
    step, micro, sample = rows.step[keep], rows.micro[keep], rows.sample[keep]
    key = step.astype(np.int64) * M + micro
    cuts = np.flatnonzero(np.diff(key)) + 1
    return [g.tolist() for g in np.split(sample, cuts)]


@pytest.mark.parametrize("epoch", [0, 1])
def test_native_replay_is_exactly_the_manifest(manifest, epoch):
    per_rank = simulate(manifest, R, epoch=epoch)
    for rank in range(R):
        assert per_rank[rank] == expected_native(manifest, epoch, rank)
    replay = ManifestReplay(manifest, rank=0, world_size=R, epoch=epoch)
    assert len(replay) == len(per_rank[0]) == replay.steps_per_epoch * M
    assert replay.elastic_report is None


@pytest.mark.parametrize("world", [1, 2, 3, R + 1, 2 * R])
def test_every_world_size_conserves_samples_with_equal_batch_counts(manifest, lengths, world):
    for epoch in (0, 1, 2):
        per_rank = simulate(manifest, world, epoch=epoch, lengths=lengths)
        counts = {len(b) for b in per_rank}
        assert len(counts) == 1, f"ranks yield different batch counts: {counts}"
        assert all(len(batch) > 0 for batches in per_rank for batch in batches)
        got = np.sort(np.concatenate([np.concatenate(b) for b in per_rank]))
        want = np.sort(epoch_rows(manifest, epoch % 2).sample)
        assert np.array_equal(got, want), "a sample is missing or repeated"
        replay = ManifestReplay(manifest, rank=world - 1, world_size=world, epoch=epoch, lengths=lengths)
        assert len(replay) == len(per_rank[0]) == replay.steps_per_epoch * replay.batches_per_step


def test_elastic_keeps_steps_together_and_is_deterministic(manifest, lengths):
    """Each replay step holds exactly the samples of one packed step; two runs give the same plan."""
    world = 3
    first = simulate(manifest, world, lengths=lengths)
    assert first == simulate(manifest, world, lengths=lengths)
    k = ManifestReplay(manifest, rank=0, world_size=world).batches_per_step
    assert k == -(-R * M // world)
    rows = epoch_rows(manifest, 0)
    for step in range(len(first[0]) // k):
        got = sorted(s for rank in range(world) for b in first[rank][step * k:(step + 1) * k] for s in b)
        assert got == sorted(rows.sample[rows.step == step].tolist())


def test_elastic_balances_by_cost(manifest, lengths):
    """LPT over cost beats dealing the same split groups to ranks in manifest order."""
    from balancer_cli.cost.samples import sample_costs
    from balancer_cli.metrics import dist_ratio_per_step
    from balancer_cli.replay.group_plan import adjust_group_count

    cost = np.sum(list(sample_costs(lengths).values()), axis=0)
    world = 3
    per_rank = simulate(manifest, world, lengths=lengths)
    replay = ManifestReplay(manifest, rank=0, world_size=world, lengths=lengths)
    k, reader = replay.batches_per_step, ManifestReader(manifest)
    ours_SR, naive_SR = [], []
    for step in range(replay.steps_per_epoch):
        ours_SR.append([sum(cost[b].sum() for b in per_rank[r][step * k:(step + 1) * k]) for r in range(world)])
        groups, _, _ = adjust_group_count(reader.step_groups(step), cost, k * world)
        naive_SR.append([sum(cost[g].sum() for g in groups[r * k:(r + 1) * k]) for r in range(world)])
    ours, naive = dist_ratio_per_step(np.array(ours_SR)), dist_ratio_per_step(np.array(naive_SR))
    assert np.mean(ours) < np.mean(naive)
    assert replay.elastic_report is not None


def test_epochs_beyond_the_packed_ones_reshuffle_steps_deterministically(manifest):
    packed = simulate(manifest, R, epoch=0)
    again = simulate(manifest, R, epoch=2)
    assert again == simulate(manifest, R, epoch=2)
    assert again != packed
    for rank in range(R):
        # Same groups per rank (balance is kept), in another step order.
        assert sorted(map(tuple, again[rank])) == sorted(map(tuple, packed[rank]))
    assert simulate(manifest, R, epoch=4) != again


@pytest.mark.parametrize("world", [R, 3])
def test_resume_at_every_batch_gives_the_rest_of_the_epoch(manifest, lengths, world, monkeypatch):
    full = simulate(manifest, world, epoch=1, lengths=lengths)
    for cut in range(0, len(full[0]) + 1, 3):
        states = []
        for rank in range(world):
            replay = ManifestReplay(manifest, rank=rank, world_size=world, epoch=1, lengths=lengths)
            it = iter(replay)
            for _ in range(cut):
                next(it)
            states.append(json.loads(json.dumps(replay.state_dict())))
        assert all(s == states[0] for s in states), "state must be the same on every rank"
        for rank in range(world):
            resumed = ManifestReplay(manifest, rank=rank, world_size=world, lengths=lengths)
            resumed.load_state_dict(states[0])
            resumed.set_epoch(1)  # the usual epoch loop keeps the loaded resume point
            assert len(resumed) == len(full[rank]) - cut
            assert list(resumed) == full[rank][cut:]
            resumed.set_epoch(1)  # ...but after iterating, set_epoch restarts the epoch
            assert list(resumed) == full[rank]


def test_resume_seeks_without_reading_earlier_steps(manifest, monkeypatch):
    full = simulate(manifest, R, epoch=1)[1]
    replay = ManifestReplay(manifest, rank=1, world_size=R, epoch=1)
    it = iter(replay)
    for _ in range(len(full) - 3):
        next(it)
    state = replay.state_dict()
    resumed = ManifestReplay(manifest, rank=1, world_size=R)
    read = []
    original = ManifestReader._row_group
    monkeypatch.setattr(ManifestReader, "_row_group", lambda self, step: read.append(step) or original(self, step))
    resumed.load_state_dict(state)
    assert list(resumed) == full[-3:]
    assert min(read) >= state["position"] + open_manifest(manifest).epoch_num_steps[0]


@pytest.mark.parametrize("saved_world, new_world", [(R, 1), (R, 2), (R, 3), (R, R + 1), (R, 2 * R), (3, R), (3, 5)])
def test_state_saved_at_one_world_size_resumes_at_another(manifest, lengths, saved_world, new_world):
    want = np.sort(epoch_rows(manifest, 0).sample)
    full = simulate(manifest, saved_world, lengths=lengths)
    for cut in (1, M + 1, len(full[0]) // 2, len(full[0]) - 1):
        replays = [ManifestReplay(manifest, rank=r, world_size=saved_world, lengths=lengths)
                   for r in range(saved_world)]
        its = [iter(s) for s in replays]
        before = [s for it in its for _ in range(cut) for s in next(it)]
        state = json.loads(json.dumps(replays[0].state_dict()))
        after = []
        for rank in range(new_world):
            replay = ManifestReplay(manifest, rank=rank, world_size=new_world, lengths=lengths)
            replay.load_state_dict(state)
            expected_len = len(replay)
            batches = list(replay)
            assert len(batches) == expected_len
            after.append(batches)
        assert len({len(b) for b in after}) == 1, "ranks must yield the same number of batches"
        got = np.sort(np.concatenate([before] + [np.concatenate(b) for b in after if b]))
        assert np.array_equal(got, want), (saved_world, new_world, cut)


def test_chained_world_size_changes_mid_step(manifest, lengths):
    """R -> 3 (mid-step) -> 5 (mid-step again) -> 2: still every sample exactly once."""
    want = np.sort(epoch_rows(manifest, 0).sample)
    seen, state, world = [], None, R
    for new_world, cut in ((3, 1), (5, 1), (2, None)):
        replays = [ManifestReplay(manifest, rank=r, world_size=world, lengths=lengths) for r in range(world)]
        if state:
            for s in replays:
                s.load_state_dict(state)
        its = [iter(s) for s in replays]
        taken = [[next(it) for _ in range(cut)] if cut else list(it) for it in its]
        assert len({len(t) for t in taken}) == 1
        seen += [s for t in taken for b in t for s in b]
        state, world = replays[0].state_dict(), new_world
    assert state["head"] is None
    assert np.array_equal(np.sort(seen), want)


def test_finished_epoch_replays_from_its_start_and_set_epoch_resets(manifest):
    replay = ManifestReplay(manifest, rank=0, world_size=R)
    first = list(replay)
    assert replay.state_dict()["position"] == open_manifest(manifest).epoch_num_steps[0]
    assert list(replay) == first and len(replay) == len(first)
    replay.set_epoch(1)
    assert list(replay) == expected_native(manifest, 1, 0)


def test_step_tokens_count_every_rank_of_the_step(manifest, lengths):
    for world in (R, 3):
        per_rank = simulate(manifest, world, lengths=lengths)
        replay = ManifestReplay(manifest, rank=0, world_size=world, lengths=lengths)
        k = replay.batches_per_step
        llm = lengths.llm_tokens()
        loss = lengths.table.column("loss_tokens").to_numpy()
        for step in range(replay.steps_per_epoch):
            samples = [s for r in range(world) for b in per_rank[r][step * k:(step + 1) * k] for s in b]
            tokens = replay.step_tokens(step)
            assert tokens.llm_tokens == llm[samples].sum() and tokens.num_samples == len(samples)
            assert tokens.loss_tokens == loss[samples].sum() == tokens.normalizer


def test_step_tokens_needs_lengths(manifest):
    with pytest.raises(UsageError, match="lengths"):
        ManifestReplay(manifest, rank=0, world_size=R).step_tokens(0)


def test_validation_errors(manifest, lengths, tmp_path):
    with pytest.raises(ManifestError, match="dataset has 10 samples"):
        ManifestReplay(manifest, rank=0, world_size=R, dataset=list(range(10)))
    other = random_lengths(300, seed=2)
    with pytest.raises(ManifestError, match="fingerprint .* is not the one"):
        ManifestReplay(manifest, rank=0, world_size=R, lengths=other)
    with pytest.raises(ManifestError, match="lengths table has 10 samples"):
        ManifestReplay(manifest, rank=0, world_size=R, lengths=random_lengths(10))
    with pytest.raises(ManifestError, match="no manifest.parquet"):
        ManifestReplay(tmp_path / "nowhere", rank=0, world_size=1)
    with pytest.raises(UsageError, match="rank 4 is not in 0..3"):
        ManifestReplay(manifest, rank=4, world_size=R)
    other_manifest = pack_random(tmp_path / "other", num_samples=300, world_size=R, micro_batches=M, seed=5)
    state = ManifestReplay(other_manifest, rank=0, world_size=R).state_dict()
    with pytest.raises(ManifestError, match="another manifest"):
        ManifestReplay(manifest, rank=0, world_size=R).load_state_dict(state)


def test_schema_version_and_corrupt_rows_are_reported(manifest, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    from balancer_cli.commit import write_commit

    table = pq.read_table(manifest / "manifest.parquet")
    meta = json.loads(table.schema.metadata[b"balancer"])
    (tmp_path / "v").mkdir()
    pq.write_table(table.replace_schema_metadata({b"balancer": json.dumps({**meta, "schema_version": 99})}),
                   tmp_path / "v" / "manifest.parquet")
    shutil.copy(manifest / "dropped.parquet", tmp_path / "v")
    write_commit(tmp_path / "v")  # a folder that is complete as written: only its content is wrong
    with pytest.raises(ManifestError, match="schema_version 99"):
        ManifestReplay(tmp_path / "v", rank=0, world_size=R)
    # Drop the rows of one group: the step then lacks a (rank, micro) group.
    keep = np.ones(table.num_rows, bool)
    step, rank = table.column("step").to_numpy(), table.column("rank").to_numpy()
    keep[(step == 0) & (rank == 2)] = False
    (tmp_path / "c").mkdir()
    pq.write_table(table.filter(keep), tmp_path / "c" / "manifest.parquet", row_group_size=table.num_rows)
    broken = dict(meta, row_group_first_steps=[0])
    bad = pq.read_table(tmp_path / "c" / "manifest.parquet")
    pq.write_table(bad.replace_schema_metadata({b"balancer": json.dumps(broken)}), tmp_path / "c" / "manifest.parquet",
                   row_group_size=table.num_rows)
    shutil.copy(manifest / "dropped.parquet", tmp_path / "c")
    write_commit(tmp_path / "c")
    with pytest.raises(ManifestError, match="step 0 has 6 groups, expected 4 ranks x 2 micro-batches"):
        list(ManifestReplay(tmp_path / "c", rank=0, world_size=R))


def test_elastic_report_is_logged_once_to_the_given_logger(manifest, caplog):
    with caplog.at_level("INFO", logger="balancer_cli.replay"):
        replay = ManifestReplay(manifest, rank=0, world_size=3)
        list(replay)
        list(replay)
    lines = [r.message for r in caplog.records if "elastic replay" in r.message]
    assert len(lines) == 1 and "packed for 4 ranks" in lines[0] and "replaying on 3 ranks" in lines[0]
    assert caplog.records[0].name == "balancer_cli.replay.cursor"


def test_replay_pickles_mid_epoch_with_its_position(manifest, lengths):
    import pickle

    for world in (R, 3):
        replay = ManifestReplay(manifest, rank=1, world_size=world, lengths=lengths)
        it = iter(replay)
        first = [next(it) for _ in range(3)]
        copy = pickle.loads(pickle.dumps(replay))
        assert copy.state_dict() == replay.state_dict()
        assert first + list(copy) == simulate(manifest, world, lengths=lengths)[1]


@pytest.mark.parametrize("rank, world_size", [(1.5, 2), (True, 2), ("0", 2), (0, 2.0), (0, "2")])
def test_a_rank_or_world_size_that_is_no_integer_is_refused(rank, world_size):
    """``ManifestReplay(rank=1.5)`` replayed rank 1's groups and ``rank=True`` rank 1's; ``"0"``
    raised a TypeError from a comparison. Each is a usage error naming the parameter."""
    from balancer_cli.errors import UsageError
    from balancer_cli.replay.cursor import check_rank

    with pytest.raises(UsageError, match=r"is not an integer \((float|bool|str)\); fix: pass (rank|world_size) as"):
        check_rank(rank, world_size)
