"""A fixed-seed slice of the engine fuzzer (tests/fuzz_engine.py): a few of its random cases, each a random
switch combination and request set, run on the tiny fp32 models and checked against Hugging Face's greedy tokens,
with the engine's page, table and cache invariants checked after every step. The seeds were picked for what they
exercise (asserted below, so that a change to the case generator that loses it shows) and include cases that
failed before the fixes they guard: a 1-token prefill chunk replayed through the decode graphs, and a hybrid
chunk cut at its branch point taking a negative page count. The fuzzer itself, for as long as you like:

    python tests/fuzz_engine.py OUT --seconds 1200
"""

from __future__ import annotations

import json

import fuzz_engine as fz
import pytest
from test_qwen35 import qwen35_path  # noqa: F401 (a fixture)

# seed -> what the case must exercise (keys of run_case's stats that must be > 0, or switches it must have)
CASES = {
    188: dict(model="qwen35", stats=("prefill_graph_replays", "decode_graph_steps")),  # failed: 1-token chunk, graph
    79: dict(model="qwen3", stats=("decode_graph_steps", "aborts"), switches=dict(max_prefill_tokens=1)),  # same
    638: dict(model="qwen35", stats=("cached_tokens",), switches=dict(mixed_prefill_tokens=6)),  # failed: alloc(-10)
    206: dict(model="qwen3", stats=("retractions", "prefill_graph_replays", "penalties")),
    193: dict(model="qwen35", stats=("retractions", "cached_tokens")),
    266: dict(model="llama", stats=("injected_failure", "retractions", "prefill_graph_replays", "aborts")),
}


@pytest.fixture(scope="module")
def fuzz_models(qwen3_path, qwen35_path, llama_path):  # noqa: F811
    # the same checkpoints as fuzz_engine.build_models builds (same builders, same seeds)
    return {"qwen3": qwen3_path, "qwen35": qwen35_path, "llama": llama_path}


@pytest.mark.parametrize("seed", list(CASES))
def test_fuzz_case(seed, fuzz_models):
    refs = fz.References(fuzz_models, None)
    case = fz.make_case(seed, refs)
    result = fz.run_case(case, fuzz_models, refs, fz.SoloReference(fuzz_models))
    assert result["ok"], json.dumps(dict(failures=result["failures"], case=case))[:4000]
    want = CASES[seed]
    assert case["model"] == want["model"]
    for key in want.get("stats", ()):
        assert result["stats"].get(key, 0) > 0, (key, result["stats"])
    for key, value in want.get("switches", {}).items():
        assert case["switches"].get(key) == value, (key, case["switches"])
    for key in want.get("case", ()):
        assert key in case or key in case["graphs"], key
