"""Fixtures shared by the engine tests: tiny checkpoints (built once per session) and an LLM factory that
checks, after every test, that the engine gave every KV page and request row back."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

# Without a GPU, Triton kernels can only run in its interpreter, and Triton picks interpreter or compiler when
# a kernel is decorated, i.e. when its module is first imported. Decide once, before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The models are tiny: thread start-up and contention with other processes on a small machine cost far
# more than the maths. One thread is ~30x faster here than two.
torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(__file__))

from helpers import assert_all_pages_back, build_tiny_model, kernel_options, save_word_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def _build(models_dir, name, arch, **kw):
    return build_tiny_model(arch, str(models_dir / name), **kw)


@pytest.fixture(scope="session")
def qwen3_path(models_dir):
    """Qwen3 (q/k norm), tied embeddings."""
    return _build(models_dir, "qwen3", "qwen3", tie=True, seed=0)


@pytest.fixture(scope="session")
def qwen3_untied_path(models_dir):
    return _build(models_dir, "qwen3-untied", "qwen3", tie=False, seed=10)


@pytest.fixture(scope="session")
def llama_path(models_dir):
    """Llama-3 with llama3 rope scaling, untied embeddings."""
    return _build(models_dir, "llama3", "llama", tie=False, seed=1)


@pytest.fixture(scope="session")
def qwen2_path(models_dir):
    """Qwen2 with non-zero q/k/v biases."""
    return _build(models_dir, "qwen2", "qwen2", tie=False, seed=2)


@pytest.fixture(scope="session")
def qwen2_sharded_path(models_dir):
    """Qwen2 (biases, untied) split over several safetensors shards with an index file."""
    return _build(models_dir, "qwen2-sharded", "qwen2", tie=False, seed=3, max_shard_size="40KB")


@pytest.fixture(scope="session")
def qwen3_tok_path(models_dir):
    """The tied Qwen3 plus a word-level tokenizer (token i <-> "w{i}"), for text prompts and stop strings."""
    path = _build(models_dir, "qwen3-tok", "qwen3", tie=True, seed=0)
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def arch_paths(qwen3_path, llama_path, qwen2_path):
    return {"qwen3": qwen3_path, "llama": llama_path, "qwen2": qwen2_path}


@pytest.fixture
def make_llm():
    """`make_llm(path, **switches)` -> LLM; at teardown every LLM made must have all its pages back."""
    from minisgl import LLM

    made = []

    def make(path, **switches):
        llm = LLM(str(path), **switches)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_all_pages_back(llm)


@pytest.fixture
def options_for_test():
    """`options_for_test(**changes)`: for the rest of the test, kernels called directly (outside any engine) run
    under the kernel options in force with `changes` (KernelOptions fields)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(kernel_options(**changes))
