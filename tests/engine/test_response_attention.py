"""A response mask with holes (tokens that are context, not the model's own) is attended
to by every forward over (prompt, response) and left out of the scores."""

from __future__ import annotations

import torch

from rlhfflow.engine.forward import response_attention, response_logprobs, response_values
from tests.conftest import make_prompt_batch


def test_response_attention_fills_holes_up_to_the_last_masked_token():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]],
                        dtype=torch.int8)
    assert response_attention(mask).tolist() == [[1, 1, 1, 1, 1, 0, 0],
                                                 [1, 1, 1, 0, 0, 0, 0],
                                                 [0, 0, 0, 0, 0, 0, 0]]


def test_a_holed_mask_scores_its_tokens_in_the_context_of_the_whole_sequence(store, tokenizer):
    batch = make_prompt_batch(tokenizer, ["describe the sun:", "a", "x y z"], samples=2)
    gen = torch.Generator().manual_seed(0)
    rows, width = 6, 12
    batch["response_ids"] = torch.randint(4, len(tokenizer), (rows, width), generator=gen)
    full = torch.ones(rows, width, dtype=torch.int8)
    holed = full.clone()
    holed[:, 3:7] = 0   # an environment's turn between two of the model's
    holed[1, 9:] = 0    # and one row that ends early
    module = store.get("actor").module
    with torch.no_grad():
        whole = response_logprobs(module, {**batch, "response_mask": full})
        scored = response_logprobs(module, {**batch, "response_mask": holed})
        values = response_values(store.get("critic").module, {**batch, "response_mask": holed})
        whole_values = response_values(store.get("critic").module,
                                       {**batch, "response_mask": full})
    torch.testing.assert_close(scored, whole * holed, atol=1e-5, rtol=0)
    torch.testing.assert_close(values, whole_values * holed, atol=1e-5, rtol=0)
    assert (scored[holed == 0] == 0).all()
