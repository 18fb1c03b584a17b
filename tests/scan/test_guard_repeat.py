"""InternVL ``repeat_time`` exactly as InternVL's own loader applies it.

The reference is a transcription of InternVL's ``LazySupervisedDataset.__init__``
(``internvl_chat/internvl/train/internvl_chat_finetune.py``), which reads the annotation's lines
and then::

    if repeat_time < 1:
        # If repeat_time is less than 1, select a portion of the data
        self.raw_data = self.raw_data[:int(len(self.raw_data) * repeat_time)]
    if repeat_time > 1:
        assert isinstance(repeat_time, int)
        # Repeat the list if repeat_time is greater than 1
        self.raw_data = self.raw_data * repeat_time

(its optional shuffle comes after and does not change which records are kept).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli.errors import InputError
from balancer_cli.scan.blocks import iter_blocks, repeat_plan
from balancer_cli.scan.inputs import expand_inputs
from balancer_cli.scan.measure import ScanConfig
from balancer_cli.scan.pipeline import scan


def internvl_records(records: list, repeat_time: float) -> list:
    """InternVL's rule, transcribed (the assertion is its refusal of a non-integer above 1)."""
    raw_data = list(records)
    if repeat_time < 1:
        raw_data = raw_data[:int(len(raw_data) * repeat_time)]
    if repeat_time > 1:
        assert isinstance(repeat_time, int)
        raw_data = raw_data * repeat_time
    return raw_data


def _meta(tmp_path: Path, n: int, repeat, name: str = "ds") -> Path:
    ann = tmp_path / f"{name}.jsonl"
    ann.write_text("".join(json.dumps({"text": f"record {i} " + "x " * i}) + "\n" for i in range(n)))
    meta = tmp_path / f"meta_{name}.json"
    meta.write_text(json.dumps({name: {"root": "", "annotation": str(ann), "repeat_time": repeat}}))
    return meta


def _kept(specs_or_paths, block_size: int = 3) -> list[tuple[int, int]]:
    """``(first_line, num_records)`` of each block, in order."""
    return [(b.first_line, b.num_records) for b in iter_blocks(specs_or_paths, block_size=block_size)]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 40), repeat=st.one_of(
    st.floats(min_value=1e-6, max_value=0.999999), st.integers(1, 4), st.sampled_from([0.5, 0.25, 0.1, 1.0, 0.999])))
def test_the_records_kept_equal_internvl_s_loader(n, repeat):
    passes, first = repeat_plan(repeat, "d.jsonl", lambda: n)
    ours = [i for _ in range(passes) for i in range(n if first is None else first)]
    assert ours == internvl_records(list(range(n)), repeat)


@pytest.mark.parametrize("repeat", [0.5, 0.1, 0.08, 1, 1.0, 2, 3, 0.99])
def test_a_scan_keeps_exactly_those_records_in_order(tmp_path, repeat):
    n = 13
    meta = _meta(tmp_path, n, repeat)
    lengths = scan([str(meta)], ScanConfig(), jobs=1, block_size=4).lengths
    # every record has its own text length, so llm_tokens says which records were kept
    single = scan([str(tmp_path / "ds.jsonl")], ScanConfig(), jobs=1).lengths.tokens("llm").tolist()
    assert lengths.tokens("llm").tolist() == internvl_records(single, repeat)


def test_a_repeat_time_that_rounds_to_zero_keeps_no_record_and_shifts_nothing(tmp_path):
    empty = _meta(tmp_path, 5, 0.1, "small")  # int(5 * 0.1) == 0
    after = _meta(tmp_path, 4, 1, "next")
    specs = expand_inputs([str(empty), str(after)])
    assert [b.source for b in iter_blocks(specs)] == ["next"]
    lengths = scan([str(empty), str(after)], ScanConfig(), jobs=1).lengths
    assert lengths.sources().tolist() == ["next"] * 4


@pytest.mark.parametrize("repeat", [2.5, 2.0, 0, -1, "2", True, None, [1]])
def test_repeat_times_internvl_refuses_are_input_errors(tmp_path, repeat):
    with pytest.raises(InputError, match="repeat_time"):
        expand_inputs([str(_meta(tmp_path, 3, repeat))])


def test_non_finite_repeat_times_are_input_errors(tmp_path):
    for literal in ("NaN", "Infinity"):
        meta = _meta(tmp_path, 3, 1)
        meta.write_text(meta.read_text().replace('"repeat_time": 1', f'"repeat_time": {literal}'))
        with pytest.raises(InputError, match="repeat_time"):
            expand_inputs([str(meta)])


@pytest.mark.parametrize("patches", [0, -3, 1.5, "6", True, 10**9])
def test_max_dynamic_patch_is_checked(tmp_path, patches):
    meta = _meta(tmp_path, 3, 1)
    data = json.loads(meta.read_text())
    data["ds"]["max_dynamic_patch"] = patches
    meta.write_text(json.dumps(data))
    with pytest.raises(InputError, match="max_dynamic_patch"):
        expand_inputs([str(meta)])
