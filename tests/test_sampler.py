"""The sampler: greedy, temperature, top-k, top-p, and seeded draws that do not depend on the batch."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, assert_all_pages_back, hf_greedy, hf_next_logits

from minisgl import SamplingParams
from minisgl.engine.sampler import SamplingTensors, apply_top_k_top_p, sample, uniform_noise


def tensors(n, vocab, temperature=1.0, top_k=-1, top_p=1.0, seeds=None, steps=None, min_p=0.0):
    def col(x, dtype):
        return torch.as_tensor(x, dtype=dtype).expand(n).clone() if not torch.is_tensor(x) or x.dim() == 0 \
            else x.to(dtype)

    temps = col(temperature, torch.float32)
    top_ks = col(top_k if isinstance(top_k, torch.Tensor) else (top_k if top_k > 0 else vocab), torch.int64)
    top_ps = col(top_p, torch.float32)
    seeds = torch.arange(n, dtype=torch.int64) if seeds is None else col(seeds, torch.int64)
    steps = torch.zeros(n, dtype=torch.int64) if steps is None else col(steps, torch.int64)
    min_ps = col(min_p, torch.float32)
    return SamplingTensors(temperatures=temps, top_ks=top_ks, top_ps=top_ps, seeds=seeds, steps=steps,
                           all_greedy=bool((temps == 0).all()),
                           any_top_k_p=bool((top_ks < vocab).any() or (top_ps < 1).any() or (min_ps > 0).any()),
                           min_ps=min_ps)


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected >= 5
    assert counts[~keep].sum() <= 0.01 * samples.numel() + 5
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8])
N = 20000


# --- the sampling function ---------------------------------------------------------------------------------

def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g) * 3
    assert torch.equal(sample(logits, tensors(64, 300, temperature=0.0)), logits.argmax(-1))
    # greedy rows stay greedy in a batch where other rows sample
    temps = torch.tensor([0.0, 1.0] * 32)
    out = sample(logits, tensors(64, 300, temperature=temps))
    assert torch.equal(out[0::2], logits.argmax(-1)[0::2])
    assert not torch.equal(out[1::2], logits.argmax(-1)[1::2])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_follow_softmax(temperature):
    logits = LOGITS8.expand(N, -1)
    out = sample(logits, tensors(N, 8, temperature=temperature))  # one draw per seed
    probs = (LOGITS8 / temperature).softmax(-1)
    assert chi_square(out, probs) < 35  # 7 degrees of freedom: p < 1e-4 beyond ~29
    # and along the steps of a single request (one seed, many output positions)
    out = sample(logits, tensors(N, 8, temperature=temperature, seeds=12345, steps=torch.arange(N)))
    assert chi_square(out, probs) < 35


def test_noise_is_uniform_and_a_pure_function():
    seeds, steps = torch.tensor([1, 1, 2, 3]), torch.tensor([0, 0, 0, 7])
    u = uniform_noise(seeds, steps, 4096)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2]) and not torch.equal(u[2], u[3])
    assert ((u > 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    assert torch.equal(uniform_noise(seeds[2:3], steps[2:3], 4096)[0], u[2])  # independent of the batch


def test_top_k_1_and_tiny_top_p_are_greedy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(256, 100, generator=g)
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, tensors(256, 100, temperature=1.5, top_k=1)), greedy)
    assert torch.equal(sample(logits, tensors(256, 100, temperature=1.5, top_p=1e-6)), greedy)
    # without the cut, the same draws are not all greedy (the test bites)
    assert not torch.equal(sample(logits, tensors(256, 100, temperature=1.5)), greedy)


def test_top_k_masks_outside_the_top_k():
    logits = LOGITS8.expand(N, -1)
    out = sample(logits, tensors(N, 8, temperature=1.0, top_k=3))
    top3 = LOGITS8.topk(3).indices
    assert set(out.unique().tolist()) == set(top3.tolist())
    probs = torch.full((8,), float("-inf"))
    probs[top3] = LOGITS8[top3]
    assert chi_square(out, probs.softmax(-1)) < 35
    masked = apply_top_k_top_p(LOGITS8[None], torch.tensor([3]), torch.tensor([1.0]))[0]
    assert torch.isinf(masked).sum() == 5 and torch.equal(masked[top3], LOGITS8[top3])


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = probs.log()
    # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: the nucleus is {0, 1}
    out = sample(logits.expand(N, -1), tensors(N, 5, top_p=0.75))
    assert set(out.unique().tolist()) == {0, 1}
    assert chi_square(out, torch.tensor([0.5, 0.3, 0, 0, 0]) / 0.8) < 20
    masked = apply_top_k_top_p(logits[None], torch.tensor([5]), torch.tensor([0.78]))[0]
    assert torch.isfinite(masked).tolist() == [True, True, False, False, False]
    # per row: top_k and top_p mix in one batch
    # the two tokens tied at 0.05 stay or go together: the threshold keeps ties whole
    both = apply_top_k_top_p(logits.expand(3, -1), torch.tensor([5, 1, 5]), torch.tensor([1.0, 1.0, 0.93]))
    assert torch.isfinite(both).sum(-1).tolist() == [5, 1, 5]


def test_min_p_keeps_tokens_near_the_top():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log()
    # min_p 0.3: tokens with probability >= 0.12 stay
    masked = apply_top_k_top_p(logits[None], torch.tensor([5]), torch.tensor([1.0]), torch.tensor([0.3]))[0]
    assert torch.isfinite(masked).tolist() == [True, True, True, False, False]
    # the temperature applies first: at T = 2 the probabilities flatten and min_p 0.3 keeps all
    hot = apply_top_k_top_p(logits[None], torch.tensor([5]), torch.tensor([1.0]), torch.tensor([0.3]),
                            torch.tensor([0.5]))[0]
    assert torch.isfinite(hot).all()
    out = sample(logits.expand(N, -1), tensors(N, 5, min_p=0.3))
    assert set(out.unique().tolist()) == {0, 1, 2}
    assert chi_square(out, torch.tensor([0.4, 0.3, 0.15, 0, 0]) / 0.85) < 20
    # min_p 0 is off; min_p 1 keeps only the argmax
    assert set(sample(logits.expand(N, -1), tensors(N, 5, min_p=0.0)).unique().tolist()) == set(range(5))
    assert torch.equal(sample(logits.expand(64, -1), tensors(64, 5, min_p=1.0)), torch.zeros(64, dtype=torch.int64))


# --- through the engine ------------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.5, top_p=0.95, max_tokens=24, ignore_eos=True, seed=1234)


def test_seeded_sampling_is_reproducible_and_batch_independent(qwen3_path, make_llm):
    prompt = PROMPTS[3]
    others = [p for i, p in enumerate(PROMPTS) if i != 3][:12]
    other_params = [SamplingParams(temperature=t, top_k=k, max_tokens=m, ignore_eos=True, seed=s)
                    for t, k, m, s in zip([0, 1.0, 0.7, 2.0] * 3, [-1, 5, -1, 50] * 3, [5, 24, 31, 9] * 3,
                                          [None, 1, 2, 1234] * 3)]
    results = {}
    for name, switches in {"alone": {}, "no-overlap": dict(overlap=False), "page4-chunk7":
                           dict(page_size=4, chunked_prefill_size=7),
                           "tiny-pool": dict(page_size=4, kv_cache_tokens=120)}.items():
        llm = make_llm(qwen3_path, **switches)
        (alone,) = llm.generate([prompt], SEEDED)
        (again,) = llm.generate([prompt], SEEDED)
        assert alone.token_ids == again.token_ids
        # in the middle of a batch of other requests, some sampling with the same seed on other prompts
        outs = llm.generate(others[:6] + [prompt] + others[6:], other_params[:6] + [SEEDED] + other_params[6:])
        assert outs[6].token_ids == alone.token_ids, name
        results[name] = alone.token_ids
        if name == "tiny-pool":
            assert llm.engine.scheduler.num_retractions > 0
        assert_all_pages_back(llm)
    assert len(set(map(tuple, results.values()))) == 1, results
    tokens = results["alone"]
    assert tokens != hf_greedy(qwen3_path, [prompt], 32)[0][:24], "sampling at T=1.5 should not be greedy"
    llm = make_llm(qwen3_path)
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.5, top_p=0.95, max_tokens=24,
                                                       ignore_eos=True, seed=99))[0].token_ids
    assert other_seed != tokens


def test_unseeded_requests_follow_the_engine_seed(qwen3_path, make_llm):
    params = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True)
    a = [o.token_ids for o in make_llm(qwen3_path, seed=7).generate(PROMPTS[:6], params)]
    b = [o.token_ids for o in make_llm(qwen3_path, seed=7).generate(PROMPTS[:6], params)]
    c = [o.token_ids for o in make_llm(qwen3_path, seed=8).generate(PROMPTS[:6], params)]
    assert a == b and a != c


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=1, max_tokens=32, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=1e-9, max_tokens=32, ignore_eos=True),
                                    SamplingParams(temperature=0.8, min_p=1.0, max_tokens=32, ignore_eos=True)],
                         ids=["top_k=1", "top_p=1e-9", "min_p=1"])
def test_engine_top_k_1_tiny_top_p_and_min_p_1_match_hf_greedy(params, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, page_size=4)
    outs = llm.generate(PROMPTS[:10], params)
    assert [o.token_ids for o in outs] == hf_greedy(qwen3_path, PROMPTS[:10])


def test_engine_top_k_draws_only_from_the_top_k(qwen3_path, make_llm):
    prompt = PROMPTS[5]
    logits = hf_next_logits(qwen3_path, prompt)
    top2 = set(logits.topk(2).indices.tolist())
    llm = make_llm(qwen3_path)
    params = [SamplingParams(temperature=50.0, top_k=2, max_tokens=1, seed=s) for s in range(40)]
    first = {o.token_ids[0] for o in llm.generate([prompt] * 40, params)}
    assert first == top2  # only the top two, and both of them (the temperature flattens the two)
    unrestricted = [SamplingParams(temperature=50.0, max_tokens=1, seed=s) for s in range(40)]
    assert len({o.token_ids[0] for o in llm.generate([prompt] * 40, unrestricted)} - top2) > 0
