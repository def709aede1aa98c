"""Penalties (engine/logits_processing.py): repetition with Hugging Face's semantics, frequency and presence
with OpenAI's formula, per request, from a count table on the device that a request without penalties never
touches. Checked against HF's RepetitionPenaltyLogitsProcessor, against a hand-computed case and a step-by-step
reference over HF's logits, and across the engine's switches (overlap, retraction, chunked prefill, graphs)."""

from __future__ import annotations

import pytest
import torch

from minisgl import SamplingParams
from minisgl.engine.logits_processing import PROMPT_BIT, apply_penalties, penalty_row_entries
from minisgl.errors import RequestError
from tests.helpers import PROMPTS, assert_all_pages_back, hf_model, hf_next_logits


def test_hand_checked_case():
    """Four tokens, counts as a request that saw token 1 in its prompt and generated 2 twice, 3 once."""
    logits = torch.tensor([[2.0, 3.0, -1.0, 0.5]])
    counts = torch.tensor([[0, PROMPT_BIT, 2, 1 | PROMPT_BIT]], dtype=torch.int32)
    apply_penalties(logits, torch.tensor([0]), counts, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0]))
    # token 0: unseen, unchanged; token 1: prompt only: 3 / 2 (no count, so no frequency or presence);
    # token 2: generated twice: -1 * 2 - 2 * 0.5 - 0.25; token 3: prompt and once: 0.5 / 2 - 0.5 - 0.25
    assert logits.tolist() == [[2.0, 1.5, -3.25, -0.5]]


def test_row_entries():
    tokens, values = penalty_row_entries([5, 7, 5], [7, 9, 9, 9])
    assert dict(zip(tokens.tolist(), values.tolist())) == {5: PROMPT_BIT, 7: PROMPT_BIT + 1, 9: 3}


def _hf_generate(path, prompt, n, **kw):
    with torch.no_grad():
        out = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_matches_hf(qwen3_path, make_llm):
    llm = make_llm(qwen3_path)
    prompts = PROMPTS[:6]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                repetition_penalty=1.3))
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == _hf_generate(qwen3_path, p, 24, repetition_penalty=1.3), p
    assert any(o.token_ids != q.token_ids for o, q in zip(outs, plain)), "the penalty changes nothing: no test"
    # a penalty below 1 favours repetition; HF's processor does the same
    low = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                   repetition_penalty=0.7))
    for p, o in zip(prompts[:2], low):
        assert o.token_ids == _hf_generate(qwen3_path, p, 16, repetition_penalty=0.7)


def _openai_reference(path, prompt, n, frequency, presence):
    """Greedy decoding over HF's logits with OpenAI's formula applied by hand at every step."""
    ids, out = list(prompt), []
    for _ in range(n):
        z = hf_next_logits(path, ids).double()
        for t in set(out):
            c = out.count(t)
            z[t] -= c * frequency + presence
        tok = int(z.argmax())
        out.append(tok)
        ids.append(tok)
    return out


@pytest.mark.parametrize("frequency,presence", [(0.8, 0.0), (0.0, 1.5), (0.6, 0.4), (-0.5, 0.0)])
def test_frequency_and_presence_follow_openai(qwen3_path, make_llm, frequency, presence):
    llm = make_llm(qwen3_path)
    prompts = PROMPTS[1:4]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=frequency,
                            presence_penalty=presence)
    for p, o in zip(prompts, llm.generate(prompts, params)):
        assert o.token_ids == _openai_reference(qwen3_path, p, 20, frequency, presence), p
    # presence: generated tokens only, never the prompt's (OpenAI's and vLLM's semantics)
    if presence and not frequency:
        assert llm.generate([prompts[0]], params)[0].token_ids[:1] == \
            llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1))[0].token_ids


MIXED = [dict(temperature=0.0, repetition_penalty=1.2), dict(temperature=0.8, seed=3, frequency_penalty=0.7),
         dict(temperature=0.0), dict(temperature=1.1, seed=5, top_k=20, presence_penalty=1.0, repetition_penalty=1.1),
         dict(temperature=0.9, seed=8), dict(temperature=0.0, frequency_penalty=-0.4, presence_penalty=0.3)]


def _mixed_params(max_tokens=30):
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **MIXED[i % len(MIXED)]) for i in range(12)]


def test_penalised_and_plain_requests_share_batches(qwen3_path, make_llm):
    """Each request's tokens are those of its run alone, across overlap on/off, a pool so small that requests
    are retracted (their count rows rebuilt from their tokens), chunked prefill and the radix cache off."""
    prompts, params = PROMPTS[:12], _mixed_params()
    alone = [make_llm(qwen3_path).generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    for switches in ({}, dict(overlap=False), dict(kv_cache_tokens=160, max_running_requests=6),
                     dict(chunked_prefill_size=16, radix_cache=False)):
        llm = make_llm(qwen3_path, **switches)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == alone, switches
        if "kv_cache_tokens" in switches:
            assert llm.engine.scheduler.num_retractions > 0, "the small pool must retract someone"
        assert_all_pages_back(llm)


def test_requests_without_penalties_never_touch_the_table(qwen3_path, make_llm):
    llm = make_llm(qwen3_path)
    llm.generate(PROMPTS[:8], SamplingParams(temperature=0.7, seed=1, max_tokens=8, ignore_eos=True))
    assert llm.engine.runner.penalties.counts.numel() == 0, "no penalised request, yet the table was allocated"
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.2))
    assert llm.engine.runner.penalties.counts.shape[0] >= 1


@pytest.mark.parametrize("field,value", [("frequency_penalty", 2.5), ("presence_penalty", -3.0),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", float("nan")),
                                         ("frequency_penalty", "1"), ("presence_penalty", True)])
def test_bad_penalties_are_refused(qwen3_path, make_llm, field, value):
    llm = make_llm(qwen3_path)
    with pytest.raises(RequestError) as e:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, **{field: value}))
    assert e.value.param == field
    assert llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids


def test_triton_kernels_equal_torch():
    """The in-place Triton kernels (kernels/sampling.py, in the interpreter on a CPU) equal the torch functions:
    penalties on fp32 logits (bit for bit) and bf16 ones, and the grammar bitmask."""
    pytest.importorskip("triton", reason="Triton is not installed (the GPU extra); the torch functions are used")
    import os

    from tests.helpers import use_triton_interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    use_triton_interpreter("minisgl.kernels.sampling")
    from minisgl.engine.logits_processing import apply_token_bitmask
    from minisgl.kernels import sampling as fused

    g = torch.Generator().manual_seed(0)
    vocab, slots = 5000, 6
    counts = torch.randint(0, 4, (slots, vocab), generator=g, dtype=torch.int32)
    counts |= (torch.rand(slots, vocab, generator=g) < 0.1).int() * PROMPT_BIT
    counts[:, :1000] = 0  # unseen tokens too
    rows, use = torch.tensor([0, 2, 3]), torch.tensor([4, 1, 5])
    freq, pres, rep = torch.tensor([0.5, -1.0, 0.0]), torch.tensor([0.3, 0.0, 2.0]), torch.tensor([1.3, 0.8, 1.0])
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(4, vocab, generator=g) * 3).to(dtype)
        ref, out = logits.clone(), logits.clone()
        apply_penalties(ref, rows, counts[use], freq, pres, rep)
        fused.apply_penalties_(out, rows, use, counts, freq, pres, rep, PROMPT_BIT - 1)
        if dtype == torch.float32:
            assert torch.equal(out, ref)
        else:  # the same fp32 value, stored as bf16: the interpreter's conversion may round the other way
            assert torch.allclose(out.float(), ref.float(), rtol=2 ** -7, atol=0), dtype
            assert torch.equal(out[[1]], logits[[1]]), "a row without penalties is left alone"
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, (vocab + 31) // 32), generator=g, dtype=torch.int64).int()
    logits = torch.randn(4, vocab, generator=g)
    ref, out = logits.clone(), logits.clone()
    apply_token_bitmask(ref, torch.tensor([1, 3]), bitmask)
    fused.apply_token_bitmask_(out, torch.tensor([1, 3]), bitmask)
    assert torch.equal(out, ref)
    assert torch.isinf(out[1]).sum() > vocab // 3 and not torch.isinf(out[0]).any()


def test_process_logits_takes_the_triton_kernels_by_the_shared_rule(monkeypatch):
    """process_logits asks kernels.elementwise.use_triton, as every kernel module does: under the kernel option
    triton_on_cpu the penalty and grammar-mask kernels run (in the interpreter), with the torch path's result."""
    pytest.importorskip("triton", reason="Triton is not installed (the GPU extra); the torch functions are used")
    import os
    from types import SimpleNamespace

    from minisgl.engine.logits_processing import LogitsProcessing, process_logits
    from tests.helpers import kernel_options, use_triton_interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    use_triton_interpreter("minisgl.kernels.sampling")
    from minisgl.kernels import sampling as fused

    g = torch.Generator().manual_seed(1)
    vocab = 3000
    table = SimpleNamespace(counts=torch.randint(0, 3, (4, vocab), generator=g, dtype=torch.int32))  # its rows
    proc = LogitsProcessing(penalty_rows=torch.tensor([0, 2]), penalty_slots=torch.tensor([3, 1]),
                            frequency=torch.tensor([0.5, 0.0]), presence=torch.tensor([0.2, 1.0]),
                            repetition=torch.tensor([1.0, 1.5]), mask_rows=torch.tensor([1]),
                            bitmask=torch.randint(-2**31, 2**31 - 1, (1, (vocab + 31) // 32), generator=g,
                                                  dtype=torch.int64).int())
    logits = torch.randn(3, vocab, generator=g)
    ref, out = logits.clone(), logits.clone()
    process_logits(ref, proc, table)  # the torch functions
    launched = []
    for name in ("apply_penalties_", "apply_token_bitmask_"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _real=real, _name=name: (launched.append(_name), _real(*a)))
    with kernel_options(triton_on_cpu=True):
        process_logits(out, proc, table)
    assert launched == ["apply_penalties_", "apply_token_bitmask_"]
    assert torch.equal(out, ref) and not torch.equal(out, logits)
