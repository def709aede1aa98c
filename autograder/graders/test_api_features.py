"""Notebook 12: penalties (HF's repetition processor, OpenAI's frequency/presence formula), a request's row of
the count table, logprobs (log-softmax, top-N), and the engine with them on a tiny model against transformers."""

from __future__ import annotations

import adapters
import pytest
import torch


def _counts(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def test_penalties_hand_checked():
    bit = adapters.prompt_bit()
    x = torch.tensor([[2.0, 3.0, -1.0, 0.5], [1.0, 1.0, 1.0, 1.0]])
    adapters.apply_penalties(x, torch.tensor([0]), _counts([[0, bit, 2, 1 | bit]]), torch.tensor([0.5]),
                             torch.tensor([0.25]), torch.tensor([2.0]))
    assert x.tolist() == [[2.0, 1.5, -3.25, -0.5], [1.0, 1.0, 1.0, 1.0]]


@pytest.mark.parametrize("penalty", [0.6, 1.3, 2.5])
def test_repetition_matches_hf(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(int(penalty * 10))
    ids = torch.randint(0, 100, (1, 40), generator=g)
    logits = torch.randn(1, 100, generator=g) * 4
    ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    counts = torch.zeros(1, 100, dtype=torch.int32)
    counts[0, ids[0]] = adapters.prompt_bit()
    adapters.apply_penalties(logits, torch.tensor([0]), counts, torch.zeros(1), torch.zeros(1),
                             torch.tensor([penalty]))
    assert torch.allclose(logits, ref)


def test_frequency_presence_formula():
    g = torch.Generator().manual_seed(1)
    c = torch.randint(0, 5, (2, 80), generator=g, dtype=torch.int32)
    z = torch.randn(3, 80, generator=g)
    f, p = torch.tensor([0.7, -1.2]), torch.tensor([-0.3, 1.1])
    want = z.clone()
    want[[2, 0]] -= c.float() * f[:, None] + (c > 0).float() * p[:, None]
    adapters.apply_penalties(z, torch.tensor([2, 0]), c, f, p, torch.ones(2))
    assert torch.allclose(z, want)


def test_row_entries():
    bit = adapters.prompt_bit()
    tokens, values = adapters.penalty_row_entries([4, 4, 9], [9, 9, 2])
    assert dict(zip(tokens.tolist(), values.tolist())) == {4: bit, 9: bit + 2, 2: 1}


def test_logprobs_are_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 300, generator=g) * 3
    tokens = torch.tensor([0, 150, 299, 7])
    chosen, ids, lps = adapters.token_logprobs(logits, tokens, 6)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(chosen, ref[torch.arange(4), tokens], atol=1e-6)
    assert torch.equal(ids, ref.topk(6).indices) and torch.allclose(lps, ref.topk(6).values, atol=1e-6)


def test_engine_penalties_and_logprobs_equal_hf(tiny_paths):
    """The engine with the student's module: repetition-penalised greedy tokens equal HF's generate, and each
    token's logprob equals HF's log-softmax at that position."""
    from transformers import AutoModelForCausalLM

    path = tiny_paths["qwen3"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = adapters.llm(path, attention_backend="torch")
    prompts = [[5, 9, 13, 9, 5, 40], [100, 101, 102]]
    outs = engine.generate(prompts, adapters.greedy(12, repetition_penalty=1.5, logprobs=2))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == ref
    o = engine.generate([prompts[0]], adapters.greedy(8, logprobs=0))[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[0] + o.token_ids])).logits[0, len(prompts[0]) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1)
    for j, (t, (lp, top)) in enumerate(zip(o.token_ids, o.logprobs)):
        assert abs(lp - ref[j, t].item()) < 1e-4 and top == []
