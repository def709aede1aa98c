"""The logprob kernels (kernels/sampling.token_logprobs_packed, issue 26) give what the torch reference
(engine/logits_processing.token_logprobs) gives, in the Triton interpreter on the CPU: the token's logprob and the
top-N, fp32 and bf16 logits, rows masked to a few tokens (a grammar), exact ties (lowest id first), every top_n
class, and only the rows asked for are read. On the engine: the same logprobs with the kernels as with torch."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (the GPU extra); the torch logprobs are used")

import torch  # noqa: E402
from helpers import PROMPTS, kernel_options, use_triton_interpreter  # noqa: E402

from minisgl import SamplingParams  # noqa: E402
from minisgl.engine.logits_processing import token_logprobs  # noqa: E402


@pytest.fixture
def fused():
    os.environ["TRITON_INTERPRET"] = "1"
    use_triton_interpreter("minisgl.kernels.sampling")
    import minisgl.kernels.sampling as fused
    return fused


def _unpack(packed: torch.Tensor, top_n: int):
    return packed[:, 0], packed[:, 1 + top_n:].contiguous().view(torch.int32).long(), packed[:, 1:1 + top_n]


def _by_value_then_id(x: torch.Tensor, top_n: int) -> torch.Tensor:
    """The top_n ids of each row, ties to the lowest id (a stable sort of -x)."""
    return torch.sort(-x.float(), dim=-1, stable=True).indices[:, :top_n]


@pytest.mark.parametrize("kind", ["fp32", "bf16", "masked", "ties"])
@pytest.mark.parametrize("top_n", [0, 1, 5, 9, 20])
def test_packed_logprobs_equal_the_torch_reference(fused, kind, top_n):
    gen = torch.Generator().manual_seed(top_n)
    b, vocab = 6, 5000  # 3 chunks, the last one partial
    x = torch.randn(b, vocab, generator=gen) * 3
    if kind == "bf16":
        x = x.bfloat16()
    elif kind == "masked":  # a grammar's mask: row 1 allows two tokens, row 2 one chunk
        x[1] = float("-inf")
        x[1, [7, 4000]] = 2.0
        x[2, 1000:] = float("-inf")
    elif kind == "ties":
        x = (x * 2).round() / 2
    rows = torch.tensor([0, 1, 2, 4])
    x[[3, 5]] = float("nan")  # rows that did not ask: never read
    tokens = torch.randint(0, vocab, (b,), generator=gen)
    tokens[1] = 4000
    packed = fused.token_logprobs_packed(x, rows, tokens, top_n)
    assert packed.shape == (4, 1 + 2 * top_n) and packed.dtype == torch.float32
    chosen, ids, lps = _unpack(packed, top_n)
    ref_chosen, _, ref_lps = token_logprobs(x[rows], tokens[rows], max(top_n, 1))
    assert torch.allclose(chosen, ref_chosen, atol=1e-5)
    finite = torch.isfinite(ref_lps[:, :top_n])
    assert torch.allclose(lps[finite], ref_lps[:, :top_n][finite], atol=1e-5)
    assert torch.equal(torch.isfinite(lps), finite)
    assert torch.equal(ids[finite], _by_value_then_id(x[rows], top_n)[finite])


def test_engine_logprobs_are_the_same_with_the_kernels(fused, qwen3_path, make_llm, monkeypatch):
    """The engine's logprobs with the kernels (triton_on_cpu: the interpreter) equal its torch path's, for a batch
    in which only some requests ask (a subset of the rows) and with different top_n."""
    calls = []
    real = fused.token_logprobs_packed
    monkeypatch.setattr(fused, "token_logprobs_packed", lambda *a: calls.append(a[3]) or real(*a))
    ask = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=n) for n in (3, None, 0, 5)]
    base = make_llm(qwen3_path).generate(PROMPTS[:4], ask, progress=False)
    assert calls == []  # CPU tensors: the torch reference
    with kernel_options(triton_on_cpu=True):
        kernels = make_llm(qwen3_path, triton_on_cpu=True).generate(PROMPTS[:4], ask, progress=False)
    assert calls and set(calls) == {5}  # the step's largest top_n, once a step
    for a, k in zip(base, kernels):
        assert a.token_ids == k.token_ids
        assert (a.logprobs is None) == (k.logprobs is None)
        for (x, top_x), (y, top_y) in zip(a.logprobs or [], k.logprobs or []):
            assert abs(x - y) < 1e-5 and [t for t, _ in top_x] == [t for t, _ in top_y]
            assert all(abs(u - v) < 1e-5 for (_, u), (_, v) in zip(top_x, top_y))
