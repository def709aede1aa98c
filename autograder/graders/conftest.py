"""Fixtures shared by the graders. Run them from the repository (or release) root:

    python -m pytest autograder/graders            # CPU graders; GPU graders skip with the reason
    python -m pytest autograder/graders -m gpu     # only the performance bars (on a GPU)

They grade whatever `minisgl` package is importable (put your release first on PYTHONPATH, or
`pip install -e .` it), through `autograder/adapters.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "autograder", ROOT / "notebooks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

torch.set_num_threads(1)  # tiny models: one thread is much faster than two on a shared machine


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: performance bars; need a CUDA GPU (skip elsewhere)")


@pytest.fixture(scope="session")
def coursekit():
    import coursekit as ck

    return ck


@pytest.fixture(scope="session")
def tiny_paths(coursekit):
    """Random tiny HF checkpoints of the three families (saved with save_pretrained)."""
    return {arch: coursekit.tiny_checkpoint(arch) for arch in ("qwen3", "llama", "qwen2")}


@pytest.fixture(scope="session")
def embedded_model(coursekit):
    return coursekit.tiny_model()
