"""The one layer-id mapping between our target_layer_ids and vLLM's (engine.config)."""

from __future__ import annotations

import pytest
import torch

from dflash_flow.engine.config import from_engine_layer_ids, to_engine_layer_ids


def test_vllm_ids_are_ours_plus_one_and_back():
    ours = [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B ids
    assert to_engine_layer_ids(ours, depth=36) == [2, 10, 18, 26, 34]
    assert from_engine_layer_ids(to_engine_layer_ids(ours, depth=36)) == ours


def test_the_mapping_names_the_stream_our_extractor_returns():
    """vLLM's id k is transformers' ``hidden_states[k]``; the mapped id must pick, out of a real model's
    hidden states, exactly what our extractor returns for our id."""
    from dflash_flow.model.features import TargetFeatureExtractor
    from dflash_flow.model.target import load_target

    model = load_target("tiny-qwen3-8l", dtype=torch.float32)
    ids = [1, 3, 6]
    ids_t = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))
    ours = TargetFeatureExtractor(model, ids)(ids_t)
    with torch.inference_mode():
        hs = model.model(input_ids=ids_t, output_hidden_states=True).hidden_states
    theirs = torch.cat([hs[k] for k in to_engine_layer_ids(ids, depth=8)], dim=-1)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # ... and the unmapped ids would be a different stream (the check can fail)
    wrong = torch.cat([hs[k] for k in ids], dim=-1)
    assert not torch.allclose(ours, wrong)


def test_the_last_layer_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="last layer.*final-normed.*up to 6"):
        to_engine_layer_ids([1, 7], depth=8)
    with pytest.raises(ValueError, match="does not exist.*8 decoder layers"):
        to_engine_layer_ids([8], depth=8)
    assert to_engine_layer_ids([7]) == [8]  # without the depth nothing is known to refuse


@pytest.mark.parametrize("bad", [[-1], [1.5], [True], []])
def test_bad_ids_are_refused(bad):
    with pytest.raises(ValueError):
        to_engine_layer_ids(bad)


def test_the_embedding_output_has_no_id_of_ours():
    with pytest.raises(ValueError, match="embedding output"):
        from_engine_layer_ids([0, 3])
