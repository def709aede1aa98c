"""Fixtures shared by the engine tests: tiny checkpoints (built once per session) and an LLM factory that
checks, after every test, that the engine gave every KV page and request row back."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

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

# pytest-xdist (`-n 2 --dist loadgroup`, pyproject.toml): a group runs on one worker, in order. The release round
# trip (tests/test_course.py, group "roundtrip") is the longest by far: it goes first so that one worker spends
# the run on it while the other takes everything else. Every other test without a group joins its module's, so
# a module's costly fixtures (servers, engines) are built once, not once per worker.
FIRST_GROUPS = ("roundtrip", "browser")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))

    def rank(item):
        group = item.get_closest_marker("xdist_group")
        name = group.args[0] if group.args else group.kwargs.get("name")
        return FIRST_GROUPS.index(name) if name in FIRST_GROUPS else len(FIRST_GROUPS)

    items.sort(key=rank)  # stable: the order within each rank is pytest's


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


# --- the course: a student release ---------------------------------------------------------------------------
COURSE_EXTRA = ("nbformat", "nbclient", "nbgrader", "plotly", "ipywidgets", "ipykernel")


def course_extra_missing() -> str:
    """Why the course tests cannot run here ("" when they can)."""
    missing = [m for m in COURSE_EXTRA if importlib.util.find_spec(m) is None]
    return f"the course extra is not installed (missing {', '.join(missing)}): pip install -e '.[course]'" \
        if missing else ""


@pytest.fixture(scope="session")
def course_release(tmp_path_factory):
    """A fresh student release (`course.py release`), built once per session (per xdist worker). Read-only:
    a test that changes a release takes its own copy (`release_copy`)."""
    if course_extra_missing():
        pytest.skip(course_extra_missing())
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "autograder"))
    import course

    tmp = tmp_path_factory.mktemp("course-release")
    course.release(tmp / "release", tmp / "work")
    return tmp / "release"


def copy_release(release: Path, out: Path) -> Path:
    """A copy of a release to change (fill notebooks, export); the large read-only folders (the model, the
    reports) are links to the original."""
    out.mkdir(parents=True)
    for entry in release.iterdir():
        if entry.name in ("assets", "reports"):
            os.symlink(entry, out / entry.name)
        elif entry.is_dir():
            shutil.copytree(entry, out / entry.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(entry, out / entry.name)
    return out


@pytest.fixture
def release_copy(course_release, tmp_path):
    """A copy of the fresh release for this test to change."""
    return copy_release(course_release, tmp_path / "release")


@pytest.fixture
def options_for_test():
    """`options_for_test(**changes)`: for the rest of the test, kernels called directly (outside any engine) run
    under the kernel options in force with `changes` (KernelOptions fields)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(kernel_options(**changes))
