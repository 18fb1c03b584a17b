"""PackedCollator: one group becomes one padding-free sequence that real transformers models train on
exactly as on its samples one by one (same summed loss, same gradients), text-only (Qwen2) and with
images (Qwen2-VL, per-sample rope positions); its keys match transformers' own flattening collator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from balancer_cli.errors import UsageError  # noqa: E402
from balancer_cli.runtime.collate import PackedCollator  # noqa: E402

VOCAB = 64
IMAGE, VISION_START, VISION_END = 60, 62, 63


def text_samples(lengths, seed=0):
    """Random token rows; every third sample has no labels, the others mask a random prompt."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, 59, (n,), generator=g)
        sample = {"input_ids": ids, "index": 100 + i}
        if i % 3:
            prompt = int(torch.randint(0, n, (), generator=g))
            sample["labels"] = torch.cat([torch.full((prompt,), -100), ids[prompt:]])
        samples.append(sample)
    return samples


def summed_loss(logits, labels):
    """Sum of token losses with transformers' causal shift (position t predicts label t+1), float64."""
    return F.cross_entropy(logits[0, :-1].double(), labels[0, 1:], ignore_index=-100, reduction="sum")


def loss_tokens(labels):
    return int((labels[..., 1:] != -100).sum())


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_training(model, unpacked_forward, packed_forward, rtol=1e-11):
    """Summed loss and gradients of the packed forward equal those of the samples run one by one.

    The model runs in float64; ``rtol`` is looser for eager attention, whose softmax runs in float32
    (rows of another length sum in another order there)."""
    model.zero_grad()
    unpacked = sum(unpacked_forward())
    unpacked.backward()
    expected = grads(model)
    model.zero_grad()
    packed, hf_loss, tokens = packed_forward()
    packed.backward()
    got = grads(model)
    assert torch.allclose(packed, unpacked, rtol=rtol, atol=0), (float(packed), float(unpacked))
    # The model's own loss (a mean over the loss tokens, computed in float32) agrees with the sum.
    assert abs(float(hf_loss.detach()) * tokens - float(unpacked.detach())) <= 1e-5 * abs(float(unpacked.detach()))
    assert got.keys() == expected.keys() and len(got) > 10
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=100 * rtol, atol=rtol), name
    return float(packed.detach())


# ------------------------------------------------------------------ conventions


@pytest.mark.parametrize("with_labels", [True, False])
def test_keys_and_values_match_transformers_flattening_collator(with_labels):
    # transformers takes labels from every sample or from none (it looks at the first); we look at each.
    samples = [s for s in text_samples([5, 1, 9, 3, 12, 4]) if ("labels" in s) == with_labels]
    ours = PackedCollator()([{k: v for k, v in s.items() if k != "index"} for s in samples])
    theirs = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{k: v.tolist() for k, v in s.items() if k != "index"} for s in samples])
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, int):
            assert ours[key] == value, key
        else:
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=8), st.integers(0, 2**16))
def test_positions_boundaries_and_labels_are_consistent(lengths, seed):
    from transformers.masking_utils import find_packed_sequence_indices
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    samples = text_samples(lengths, seed)
    batch = PackedCollator(block_mask=torch.bool)(samples)
    n, T = len(lengths), sum(lengths)
    cu = batch["cu_seq_lens_q"]
    assert cu.dtype == torch.int32 and cu.tolist() == [sum(lengths[:i]) for i in range(n + 1)]
    assert batch["cu_seq_lens_k"] is cu and batch["max_length_q"] == batch["max_length_k"] == max(lengths)
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    assert ids.shape == labels.shape == pos.shape == (1, T) and ids.dtype == labels.dtype == torch.long
    # Every token once, in sample order; positions restart; each sample's first label is masked.
    for i, s in enumerate(samples):
        a, b = cu[i], cu[i + 1]
        assert torch.equal(ids[0, a:b], s["input_ids"])
        assert pos[0, a:b].tolist() == list(range(lengths[i]))
        assert labels[0, a] == -100
        assert torch.equal(labels[0, a + 1:b], s.get("labels", s["input_ids"])[1:])
    assert batch["index"] == [s["index"] for s in samples]
    # What transformers derives from these position_ids is the same segmentation.
    (cu_q, _), (max_q, _) = prepare_fa_kwargs_from_position_ids(pos)
    assert cu_q.tolist() == cu.tolist() and int(max_q) == max(lengths)
    segment = torch.repeat_interleave(torch.arange(n), torch.tensor(lengths))
    found = find_packed_sequence_indices(pos)
    assert (found is None) == (n == 1) and (n == 1 or torch.equal(found[0], segment))
    keep = batch["attention_mask"][0, 0]
    q, k = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    assert torch.equal(keep, (segment[q] == segment[k]) & (k <= q))


# ------------------------------------------------------------------ a text model


@pytest.fixture(scope="module")
def qwen2():
    def build(attn):
        config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          bos_token_id=1, eos_token_id=2, attn_implementation=attn)
        torch.manual_seed(0)
        return transformers.Qwen2ForCausalLM(config).double()
    return build


@pytest.mark.parametrize("attn, block_mask", [("sdpa", None), ("eager", None), ("sdpa", torch.bool),
                                              ("eager", torch.float64)])
def test_packed_qwen2_trains_like_its_samples_one_by_one(qwen2, attn, block_mask):
    model = qwen2(attn)
    samples = text_samples([5, 1, 9, 3, 12, 7], seed=1)
    batch = PackedCollator(block_mask=block_mask)(samples)
    rows = [(s["input_ids"][None], s.get("labels", s["input_ids"])[None]) for s in samples]

    def unpacked():
        return [summed_loss(model(input_ids=ids).logits, y) for ids, y in rows]

    def packed():
        inputs = {k: v for k, v in batch.items() if k != "index"}
        # Without a block mask, sdpa/eager find the boundaries in position_ids only without a KV cache;
        # a block mask works with one too.
        out = model(**inputs, use_cache=block_mask is not None)
        return summed_loss(out.logits, batch["labels"]), out.loss, loss_tokens(batch["labels"])

    assert assert_same_training(model, unpacked, packed, rtol=1e-7 if attn == "eager" else 1e-11) > 0


def test_with_a_cache_and_no_block_mask_samples_attend_to_each_other(qwen2):
    """The pitfall the docs warn about: transformers skips packed detection when a cache exists."""
    model = qwen2("sdpa")
    samples = text_samples([6, 8], seed=2)
    batch = PackedCollator()(samples)
    inputs = {k: v for k, v in batch.items() if k not in ("index", "labels")}
    alone = model(input_ids=samples[1]["input_ids"][None]).logits
    leaky = model(**inputs, use_cache=True).logits[:, 6:]
    isolated = model(**inputs, use_cache=False).logits[:, 6:]
    assert torch.allclose(isolated, alone, atol=1e-12) and not torch.allclose(leaky, alone, atol=1e-3)


# ------------------------------------------------------------------ a vision-language model


@pytest.fixture(scope="module")
def qwen2_vl():
    config = transformers.Qwen2VLConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                     "bos_token_id": 1, "eos_token_id": 2,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4}},
        vision_config={"depth": 1, "embed_dim": 16, "num_heads": 2, "hidden_size": 32, "mlp_ratio": 2, "patch_size": 2,
                       "temporal_patch_size": 2, "in_channels": 3, "spatial_merge_size": 2},
        image_token_id=IMAGE, video_token_id=61, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Qwen2VLForConditionalGeneration(config).double()


def vl_sample(grids, text, g):
    """Text around images with grids (t, h, w): t*h*w patches of 24 values, t*h*w/4 image tokens each."""
    ids, pixels = [torch.randint(1, 59, (text,), generator=g)], []
    for t, h, w in grids:
        ids += [torch.tensor([VISION_START]), torch.full((t * h * w // 4,), IMAGE), torch.tensor([VISION_END]),
                torch.randint(1, 59, (3,), generator=g)]
        pixels.append(torch.randn(t * h * w, 24, generator=g, dtype=torch.float64))
    ids = torch.cat(ids)
    sample = {"input_ids": ids, "labels": ids.masked_fill(ids >= IMAGE, -100),
              "mm_token_type_ids": (ids == IMAGE).int()}
    if grids:
        sample |= {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids)}
    return sample


@pytest.mark.parametrize("block_mask", [None, torch.bool])
def test_packed_qwen2_vl_with_images_trains_like_its_samples_one_by_one(qwen2_vl, block_mask):
    model = qwen2_vl
    g = torch.Generator().manual_seed(3)
    samples = [vl_sample([(1, 4, 4)], 4, g), vl_sample([], 9, g), vl_sample([(1, 4, 4), (1, 4, 8)], 2, g)]
    for s in samples:  # the model's own multi-axis rope positions, sample by sample
        s["position_ids"] = model.model.get_rope_index(s["input_ids"][None], s["mm_token_type_ids"][None],
                                                       image_grid_thw=s.get("image_grid_thw"))[0]
    batch = PackedCollator(block_mask=block_mask)(samples)
    T = sum(len(s["input_ids"]) for s in samples)
    assert batch["position_ids"].shape == (4, 1, T) and batch["pixel_values"].shape == (16 + 16 + 32, 24)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4], [1, 4, 8]]

    def unpacked():
        return [summed_loss(model(**{k: v[None] if k in ("input_ids", "mm_token_type_ids") else v
                                     for k, v in s.items() if k not in ("labels", "position_ids")}).logits,
                            s["labels"][None]) for s in samples]

    def packed():
        out = model(**batch, use_cache=False)
        return summed_loss(out.logits, batch["labels"]), out.loss, loss_tokens(batch["labels"])

    assert assert_same_training(model, unpacked, packed) > 0
    if block_mask is not None:
        return
    # Without per-sample rope positions the model numbers the packed row as one sequence: not the same.
    plain = {k: v for k, v in batch.items() if k != "position_ids"}
    assert not torch.allclose(summed_loss(model(**plain, use_cache=False).logits, batch["labels"]),
                              sum(unpacked()), rtol=1e-6)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("group, message", [
    ([], "the group to collate has no samples"),
    ([{"input_ids": [1, 2]}, {"labels": [1], "index": 7}], "sample 1 of the group, index 7 has no 'input_ids'"),
    ([[1, 2]], "sample 0 of the group is a list, not a mapping"),
    ([{"input_ids": []}], "sample 0 of the group: 'input_ids' is empty"),
    ([{"input_ids": [[1, 2], [3, 4]]}], "'input_ids' has shape (2, 2); packing takes one sequence"),
    ([{"input_ids": [1, 2, 3], "labels": [1, 2], "index": 3}],
     "sample 0 of the group, index 3: 'labels' has 2 values, 'input_ids' has 3 tokens"),
    ([{"input_ids": [1, 2], "mm_token_type_ids": [0]}], "'mm_token_type_ids' has 1 values, 'input_ids' has 2"),
    ([{"input_ids": [1, 2], "mm_token_type_ids": [0, 0]}, {"input_ids": [3]}],
     "sample 1 of the group: has no 'mm_token_type_ids' but other samples of the group have it"),
    ([{"input_ids": [1], "pixel_values": torch.zeros(4, 24)}, {"input_ids": [2], "pixel_values": torch.zeros(4, 12)}],
     "sample 1 of the group: 'pixel_values' has shape (4, 12), earlier samples of the group have (n, 24)"),
    ([{"input_ids": [1], "image_grid_thw": 3}], "'image_grid_thw' is a scalar"),
    ([{"input_ids": [1, 2], "attention_mask": [1, 0]}], "'attention_mask' masks 1 of 2 tokens"),
    ([{"input_ids": [1, 2], "position_ids": [0, 1]}], "'position_ids' has shape (2,), not (P, 2) rope positions"),
    ([{"input_ids": [1], "position_ids": [[0]] * 3}, {"input_ids": [2]}],
     "sample 1 of the group: 'position_ids' must have the same number of rows"),
    ([{"input_ids": [1], "caption": "a cat"}], "the collator does not know key 'caption'; fix: list it in token_keys"),
])
def test_bad_groups_are_one_line_usage_errors(group, message):
    with pytest.raises(UsageError) as error:
        PackedCollator()(group)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_config_is_checked_and_an_all_ones_mask_is_dropped():
    with pytest.raises(UsageError, match="block_mask torch.int64 is neither torch.bool nor a float dtype"):
        PackedCollator(block_mask=torch.int64)
    batch = PackedCollator(flash_kwargs=False, list_keys=("index", "id"))(
        [{"input_ids": [4, 5], "attention_mask": [1, 1], "id": "a"}, {"input_ids": [6], "index": 2}])
    assert sorted(batch) == ["id", "index", "input_ids", "labels", "position_ids"]
    assert batch["id"] == ["a", None] and batch["index"] == [None, 2]
