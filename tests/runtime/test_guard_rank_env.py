"""The rank and world size a sampler replays for: refused, in one line naming the parameter or the
environment variable and its value, when they are not integers, are out of range, or the environment
gives one of RANK/WORLD_SIZE without the other (every process would be rank 0 of 1)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from replay_util import pack_random

from balancer_cli.errors import UsageError
from balancer_cli.runtime.ranks import resolve_rank
from balancer_cli.runtime.sampler import ManifestBatchSampler


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return pack_random(tmp_path_factory.mktemp("m") / "out", num_samples=60, world_size=2, micro_batches=1)


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and "; fix: " in text, text
    return text


def test_rank_without_world_size_in_the_environment_is_refused(env, manifest):
    env.setenv("RANK", "1")
    with pytest.raises(UsageError) as error:
        ManifestBatchSampler(manifest)
    assert "RANK is 1 but WORLD_SIZE is not set" in one_line(error)
    with pytest.raises(UsageError, match="RANK is 1"):
        resolve_rank()
    env.setenv("RANK", "0")  # rank 0 of 1 is what it says
    assert resolve_rank() == (0, 1)
    env.setenv("WORLD_SIZE", "2")
    env.setenv("RANK", "1")
    assert resolve_rank() == (1, 2)
    assert resolve_rank(0, 4) == (0, 4)  # both explicit: the environment is not consulted


def test_rank_alone_is_read_from_torch_distributed_once_initialized(env):
    env.setenv("RANK", "1")
    env.setattr(torch.distributed, "is_initialized", lambda: True)
    env.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    env.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    assert resolve_rank() == (1, 3)


@pytest.mark.parametrize(("variables", "named"), [
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "environment variable RANK is 'abc', not an integer"),
    ({"RANK": "1", "WORLD_SIZE": "two"}, "environment variable WORLD_SIZE is 'two', not an integer"),
    ({"RANK": "1.0", "WORLD_SIZE": "2"}, "environment variable RANK is '1.0'"),
    ({"WORLD_SIZE": "x"}, "environment variable WORLD_SIZE is 'x'"),
    ({"RANK": "abc"}, "environment variable RANK is 'abc'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 and WORLD_SIZE=2 do not satisfy 0 <= RANK < WORLD_SIZE"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 and WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "RANK=0 and WORLD_SIZE=0"),
])
def test_environment_values_that_are_not_a_rank_are_refused_naming_the_variable(env, manifest, variables, named):
    for name, value in variables.items():
        env.setenv(name, value)
    with pytest.raises(UsageError) as error:
        ManifestBatchSampler(manifest)
    assert named in one_line(error)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"rank": 1.5, "world_size": 2}, "rank 1.5 is not an integer (float)"),
    ({"rank": 1.0, "world_size": 2}, "rank 1.0 is not an integer (float)"),
    ({"rank": True, "world_size": 2}, "rank True is not an integer (bool)"),
    ({"rank": np.bool_(True), "world_size": 2}, "is not an integer (bool)"),
    ({"rank": "0", "world_size": 2}, "rank '0' is not an integer (str)"),
    ({"rank": 0, "world_size": "2"}, "world_size '2' is not an integer (str)"),
    ({"rank": 0, "world_size": 2.0}, "world_size 2.0 is not an integer (float)"),
    ({"rank": 0, "world_size": False}, "world_size False is not an integer (bool)"),
    ({"rank": 2, "world_size": 2}, "rank 2 is not in 0..1"),
    ({"rank": -1, "world_size": 2}, "rank -1 is not in 0..1"),
    ({"rank": 0, "world_size": 0}, "is not in 0..-1"),
])
def test_arguments_that_are_not_a_rank_are_refused_naming_the_parameter(env, manifest, kwargs, named):
    with pytest.raises(UsageError) as error:
        ManifestBatchSampler(manifest, **kwargs)
    assert named in one_line(error)
    with pytest.raises(UsageError):
        resolve_rank(**kwargs)


def test_integers_of_any_integer_type_are_accepted(env, manifest):
    expected = list(ManifestBatchSampler(manifest, rank=1, world_size=2))
    for rank, world in ((np.int64(1), np.int32(2)), (torch.tensor(1), 2)):
        sampler = ManifestBatchSampler(manifest, rank=rank, world_size=world)
        assert list(sampler) == expected
        assert resolve_rank(rank, world) == (1, 2) and type(resolve_rank(rank, world)[0]) is int
