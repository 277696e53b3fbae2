"""``engine.turns``: rows leave the decode batch with their KV cache and rejoin with new
tokens; the logits are those of one forward over each row's whole sequence."""

from __future__ import annotations

import torch

from rlhfflow.engine.forward import position_ids
from rlhfflow.engine.models import build_tiny_model
from rlhfflow.engine.turns import TurnBatch, pack
from tests.conftest import padded_ids


def _fresh_last_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    """The logits after each sequence, from one forward over it alone."""
    rows = []
    for seq in sequences:
        ids = torch.tensor([seq])
        mask = torch.ones_like(ids)
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


@torch.no_grad()
def test_parked_rows_rejoin_on_their_cache_as_if_prefilled_whole(tokenizer):
    model = build_tiny_model(tokenizer, "lm", seed=0).eval()
    ids, mask, _ = padded_ids(rows=4, length=9)
    sequences = [ids[r][mask[r].bool()].tolist() for r in range(4)]
    batch = TurnBatch(model)
    batch.start([10, 11, 12, 13], ids, mask)
    # two decode steps with fixed tokens, then rows 11 and 13 leave with their caches
    for token in (5, 6):
        logits = batch.step(torch.full((4,), token))
        for seq in sequences:
            seq.append(token)
    torch.testing.assert_close(logits, _fresh_last_logits(model, sequences), atol=1e-5,
                               rtol=0)
    parked = batch.park([1, 3])
    assert batch.rows == [10, 12]
    assert [c.length for c in parked] == [len(sequences[1]), len(sequences[3])]
    for token in (7, 8, 9):  # the others decode on
        batch.step(torch.full((2,), token))
        sequences[0].append(token)
        sequences[2].append(token)
    # the parked rows come back with answers of different lengths
    answers = {1: [14, 15, 16], 3: [17]}
    blocks = [answers[r] for r in (1, 3)]
    for r in (1, 3):
        sequences[r] += answers[r]
    joined = batch.join([11, 13], parked, blocks, pad_id=0)
    torch.testing.assert_close(joined, _fresh_last_logits(model, [sequences[1], sequences[3]]),
                               atol=1e-5, rtol=0)
    assert batch.rows == [10, 12, 11, 13]
    # one more step of all four: each row as a fresh forward over its sequence
    logits = batch.step(torch.tensor([20, 21, 22, 23]))
    for seq, token in zip((sequences[0], sequences[2], sequences[1], sequences[3]),
                          (20, 21, 22, 23), strict=True):
        seq.append(token)
    fresh = _fresh_last_logits(model, [sequences[0], sequences[2], sequences[1],
                                       sequences[3]])
    torch.testing.assert_close(logits, fresh, atol=1e-5, rtol=0)
    # packing drops the holes and changes nothing
    width = batch.state.mask.shape[1]
    pack(batch.state)
    assert batch.state.mask.shape[1] <= width and batch.state.mask[:, -1].all()
    logits = batch.step(torch.tensor([1, 2, 3, 4]))
    for seq, token in zip((sequences[0], sequences[2], sequences[1], sequences[3]),
                          (1, 2, 3, 4), strict=True):
        seq.append(token)
    fresh = _fresh_last_logits(model, [sequences[0], sequences[2], sequences[1],
                                       sequences[3]])
    torch.testing.assert_close(logits, fresh, atol=1e-5, rtol=0)


@torch.no_grad()
def test_rows_without_a_cache_are_prefilled_whole(tokenizer):
    model = build_tiny_model(tokenizer, "lm", seed=0).eval()
    ids, mask, _ = padded_ids(rows=3, length=7)
    sequences = [ids[r][mask[r].bool()].tolist() for r in range(3)]
    batch = TurnBatch(model)
    batch.start([0, 1, 2], ids, mask)
    parked = batch.park([0, 2], keep_cache=False)
    assert parked == [None, None] and batch.rows == [1]
    blocks = [sequences[0] + [9, 9], sequences[2] + [4]]
    logits = batch.join([0, 2], parked, blocks, pad_id=0)
    torch.testing.assert_close(logits, _fresh_last_logits(model, blocks), atol=1e-5, rtol=0)
    assert batch.rows == [1, 0, 2] and batch.state.rows == 3
