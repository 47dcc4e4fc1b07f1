"""collate: padded batches whose masks line up with the model's predictions, on a real tiny model."""

from __future__ import annotations

import pytest
import torch
from streamrl.agents.batch import collate, pad_right
from streamrl.agents.logprobs import selected_token_logprobs, token_logprobs
from streamrl.agents.models import load_model, resolve_model
from streamrl.agents.trajectory import TokenSequence


def _sequence(prompt: list[int], action: list[int], obs: list[int], action2: list[int]) -> TokenSequence:
    seq = TokenSequence()
    seq.extend_context(prompt)
    seq.extend_action(action, [-0.5 - 0.1 * i for i in range(len(action))], version=3)
    seq.extend_context(obs)
    seq.extend_action(action2, [-1.0] * len(action2), version=4)
    return seq


def test_collate_shifts_masks_onto_predictions() -> None:
    short = _sequence([5, 6], [7, 8], [9], [10])
    long = _sequence([5, 6, 7, 8], [11], [12, 13], [14, 15, 16])
    batch = collate([short, long], pad_token_id=0, pad_to_multiple_of=4)
    assert batch.input_ids.shape == (2, 12) and batch.action_mask.shape == (2, 11)
    for row, seq in enumerate([short, long]):
        for k in range(1, len(seq)):  # prediction k-1 is about token k
            assert bool(batch.action_mask[row, k - 1]) == bool(seq.action_mask[k])
            assert float(batch.rollout_logprobs[row, k - 1]) == pytest.approx(seq.rollout_logprobs[k])
            assert int(batch.token_versions[row, k - 1]) == seq.token_versions[k]
        assert not batch.target_mask[row, len(seq) - 1 :].any()  # padding is never a target
    assert batch.lengths.tolist() == [short.num_action_tokens, long.num_action_tokens]
    assert batch.num_action_tokens == short.num_action_tokens + long.num_action_tokens
    assert not (batch.context_mask & batch.action_mask).any()
    assert int((batch.context_mask | batch.action_mask).sum()) == len(short) - 1 + len(long) - 1


def test_collated_logprobs_equal_each_sequence_scored_alone() -> None:
    torch.manual_seed(0)
    model = load_model(resolve_model("tiny"))
    model.eval()
    seqs = [_sequence([1, 2, 3], [4, 5], [6, 7, 8], [9]), _sequence([1, 2], [30, 31, 32], [40], [41, 42])]
    batch = collate(seqs, pad_token_id=0)
    with torch.no_grad():
        selected = selected_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
        dense = batch.scatter(selected)
        for row, seq in enumerate(seqs):
            alone = token_logprobs(
                model, torch.tensor([seq.token_ids]), torch.ones(1, len(seq), dtype=torch.long)
            )
            want = alone[0][torch.tensor(seq.action_mask[1:], dtype=torch.bool)]
            got = dense[row][batch.action_mask[row]]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (dense[~batch.action_mask] == 0).all()


def test_collate_rejects_what_cannot_be_trained() -> None:
    with pytest.raises(ValueError, match="at least one sequence"):
        collate([], 0)
    first = TokenSequence()
    first.extend_action([3, 4], [-0.1, -0.2], version=0)
    with pytest.raises(ValueError, match="starts with an action token"):
        collate([first], 0)
    with pytest.raises(ValueError, match="more than width"):
        pad_right([[1, 2, 3]], 0, width=2)
    batch = collate([_sequence([1], [2], [3], [4])], 0)
    with pytest.raises(ValueError, match="select has 2 positions"):
        batch.scatter(torch.zeros(3))
