"""The fused Triton sampler draws exactly what the torch sampler draws (Triton interpreter on the CPU)."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (the GPU extra); the torch sampler is used")

import torch  # noqa: E402

from minisgl.engine.sampler import SamplingTensors, sample  # noqa: E402


def _interpreted_gumbel_argmax():
    """The kernel module decorated under the interpreter: another test may have imported it without."""
    import importlib

    import minisgl.kernels.sampling as fused
    os.environ["TRITON_INTERPRET"] = "1"
    return importlib.reload(fused).gumbel_argmax


@pytest.mark.parametrize("vocab,chunk", [(3000, 1024), (777, 256)])
def test_fused_matches_torch(vocab, chunk):
    gumbel_argmax = _interpreted_gumbel_argmax()
    gen = torch.Generator().manual_seed(vocab)
    b = 6
    logits = torch.randn(b, vocab, generator=gen) * 3
    temps = torch.tensor([0.0, 0.6, 1.0, 2.0, 0.6, 0.0])
    seeds = torch.randint(0, 2**31, (b,), generator=gen)
    steps = torch.randint(0, 1000, (b,), generator=gen)
    st = SamplingTensors(temps, torch.full((b,), vocab), torch.ones(b), seeds, steps, False, False)
    assert gumbel_argmax(logits, temps, seeds, steps, chunk=chunk).tolist() == sample(logits, st).tolist()
    # greedy rows are plain argmax
    got = gumbel_argmax(logits, temps, seeds, steps, chunk=chunk)
    assert got[0] == logits[0].argmax() and got[5] == logits[5].argmax()
