"""Every BalancerError round-trips through pickle (process pools, Ray) with all of its fields."""

from __future__ import annotations

import copy
import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest

from balancer_cli.errors import BalancerError, InputError, ManifestError, PlanError, SampleError, UsageError
from balancer_cli.scan.rules.base import MediaRejected


class _PositionalError(InputError):
    """A subclass whose constructor takes other arguments than the base's (the default reduce breaks)."""

    def __init__(self, path: str, value: int) -> None:
        super().__init__(f"{path}: bad value {value}", fix="use another value")
        self.path, self.value = path, value


def _fields(error: BaseException) -> tuple:
    return type(error), error.args, dict(error.__dict__), str(error)


ERRORS = [
    BalancerError("plain"),
    InputError("lengths.parquet: column missing", fix="run `balancer scan` first"),
    UsageError("--jobs -1 must be >= 0"),
    ManifestError("manifest/: schema 9", fix="rebuild"),
    PlanError("nothing fits"),
    SampleError("image not found: a.png", kind="missing_file", file="data.jsonl", line=7, fix="check --image-root"),
    SampleError("no location", kind="corrupt_image"),
    MediaRejected("aspect ratio 400 > 200", file="d.json", line=2),
    _PositionalError("x.parquet", 3),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_round_trip_keeps_every_field(error):
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        again = pickle.loads(pickle.dumps(error, protocol=protocol))
        assert _fields(again) == _fields(error)
    assert _fields(copy.copy(error)) == _fields(error)
    if isinstance(error, SampleError):
        again = pickle.loads(pickle.dumps(error))
        assert (again.kind, again.file, again.line, again.fix, again.location) == (
            error.kind, error.file, error.line, error.fix, error.location)
        assert again.exit_code == error.exit_code


def _raise_sample_error(line: int) -> None:
    raise SampleError("corrupt PNG header", kind="corrupt_image", file="d.jsonl", line=line, fix="re-encode it")


def test_sample_error_crosses_a_process_pool_whole():
    with ProcessPoolExecutor(max_workers=1) as pool:
        with pytest.raises(SampleError) as caught:
            pool.submit(_raise_sample_error, 12).result()
    assert (caught.value.kind, caught.value.file, caught.value.line, caught.value.fix) == (
        "corrupt_image", "d.jsonl", 12, "re-encode it")
    assert str(caught.value) == "d.jsonl:12: corrupt PNG header; fix: re-encode it"
