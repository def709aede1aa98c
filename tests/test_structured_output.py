"""Structured output (minisgl/grammar.py, xgrammar): every constrained output parses and follows its
constraint (200 random JSON schemas checked with jsonschema; JSON objects; a regex; an EBNF grammar), the
overlap loop gives the tokens of the plain loop (the masks of a step are built once the tokens before it
reached the host), and a bad constraint is a clear error that leaves the engine serving."""

from __future__ import annotations

import json
import random
import re

import pytest

from minisgl import SamplingParams, StructuredOutput
from minisgl.errors import RequestError
from tests.helpers import TINY_QWEN3_ASSET, assert_all_pages_back

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (the grammar extra)")
jsonschema = pytest.importorskip("jsonschema")

WORDS = ["name", "id", "kind", "size", "tags", "owner", "path", "mode", "count", "ok", "note", "items"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema of bounded output size: strings with maxLength, integers with a range, arrays with
    maxItems, enums, booleans, nulls, and nested objects two levels deep."""
    kinds = ["string", "integer", "boolean", "enum", "null", "array"] + (["object"] * 2 if depth < 2 else [])
    kind = rng.choice(kinds) if depth else "object"
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "auto", "none", "x1"], rng.randint(1, 4))}
    if kind == "array":
        item = random_schema(rng, depth + 1) if depth < 2 else {"type": "boolean"}
        return {"type": "array", "items": item, "maxItems": rng.randint(1, 3)}
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@pytest.fixture(scope="module")
def schemas():
    rng = random.Random(0)
    return [random_schema(rng) for _ in range(200)]


PROMPTS = ["The function returns", "A dictionary with", "Example:", "Configuration"]


def _params(schemas):
    return [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=256,
                           structured_output=StructuredOutput("json_schema", json.dumps(s)))
            for i, s in enumerate(schemas)]


def test_200_random_schemas_parse_and_validate_overlap_on_and_off(make_llm, schemas):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))]
    runs = {}
    for overlap in (True, False):
        llm = make_llm(TINY_QWEN3_ASSET, overlap=overlap)
        outs = llm.generate(prompts, _params(schemas))
        for i, (o, s) in enumerate(zip(outs, schemas)):
            assert o.finish_reason == "stop", (i, o.finish_reason, o.text)
            jsonschema.validate(json.loads(o.text), s)
        runs[overlap] = [o.token_ids for o in outs]
        assert_all_pages_back(llm)
    assert runs[True] == runs[False], "overlap on and off must draw the same tokens"


def test_json_object_regex_and_ebnf(make_llm):
    llm = make_llm(TINY_QWEN3_ASSET)
    outs = llm.generate(PROMPTS * 2, [SamplingParams(temperature=0.8 if i else 0.0, seed=i, max_tokens=300,
                                                     structured_output=StructuredOutput("json_object"))
                                      for i in range(8)])
    # a free JSON object's strings have no length bound, and this model writes documentation: some run past
    # max_tokens; every one that ended is a JSON object
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= 4 and all(isinstance(json.loads(o.text), dict) for o in done), [o.text for o in outs]
    pattern = r"v[0-9]{1,2}\.[0-9]{1,2}(-(alpha|beta))?"
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                                                 structured_output=StructuredOutput("regex", pattern))
                                  for i in range(4)])
    assert all(re.fullmatch(pattern, o.text) for o in outs), [o.text for o in outs]
    grammar = 'root ::= answer " because " reason "."\nanswer ::= "yes" | "no"\nreason ::= [a-z]+ (" " [a-z]+)?'
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                                                 structured_output=StructuredOutput("ebnf", grammar))
                                  for i in range(4)])
    assert all(re.fullmatch(r"(yes|no) because [a-z]+( [a-z]+)?\.", o.text) for o in outs), [o.text for o in outs]


def test_constrained_and_free_requests_share_batches(make_llm):
    """A free request's tokens do not change when constrained ones run beside it; n > 1 and logprobs too."""
    llm = make_llm(TINY_QWEN3_ASSET)
    free = SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], free)[0].token_ids
    so = StructuredOutput("json_object")
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [free, SamplingParams(temperature=0.9, seed=3, n=3, logprobs=2,
                                                                         max_tokens=120, structured_output=so)])
    assert outs[0].token_ids == alone
    for o in outs[1:]:
        assert isinstance(json.loads(o.text), dict) and len(o.logprobs) == len(o.token_ids)
        # the mask sends the forbidden tokens to -inf: what was drawn had a finite logprob
        assert all(lp > float("-inf") for lp, _ in o.logprobs)


@pytest.mark.parametrize("so", [StructuredOutput("json_schema", "{not json"), StructuredOutput("regex", "(unclosed"),
                                StructuredOutput("ebnf", "root ::= undefined_rule")])
def test_bad_constraints_are_refused_and_the_engine_keeps_serving(make_llm, so):
    llm = make_llm(TINY_QWEN3_ASSET)
    with pytest.raises(RequestError) as e:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, structured_output=so))
    assert e.value.param == "response_format"
    assert llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids


def test_bad_kinds_are_refused():
    for kind, spec in (("yaml", "a: 1"), ("regex", ""), ("json_schema", 5)):
        with pytest.raises(RequestError):
            StructuredOutput(kind, spec)


def test_masks_go_through_one_reused_host_buffer_and_a_finished_matcher_allows_everything(make_llm):
    """A step's grammar masks are written into the runner's host buffer (pinned on a GPU), the same memory from
    step to step, grown when a step has more rows; a row whose matcher has terminated is all ones even where the
    buffer held an older mask."""
    import torch

    from minisgl.grammar import Grammars, bitmask_words

    llm = make_llm(TINY_QWEN3_ASSET)
    runner = llm.engine.runner
    a, b = runner.mask_buffer(2), runner.mask_buffer(1)
    assert a.data_ptr() == b.data_ptr() and a.dtype == torch.int32
    assert a.shape == (2, bitmask_words(llm.engine.model_config.vocab_size))
    grown = runner.mask_buffer(40)
    assert grown.shape[0] == 40 and runner.mask_buffer(3).data_ptr() == grown.data_ptr()

    class Matcher:
        def __init__(self, done: bool):
            self.done = done

        def is_terminated(self) -> bool:
            return self.done

        def fill_next_token_bitmask(self, mask, i: int) -> None:
            mask[i] = 5

    mask = runner.mask_buffer(2)
    mask.zero_()  # an older step's masks
    Grammars.fill(None, [Matcher(False), Matcher(True)], mask)
    assert (mask[0] == 5).all() and (mask[1] == -1).all()


def test_the_api_checks_timing_of_a_structured_step_splits_the_hosts_time(make_llm):
    """lab.checks.h200_api_check's diagnosis of the json arms' extra TPOT: per step, the host's phases and, inside
    them, the masks' fill and the processed sampling; the engine's methods are its own again afterwards."""
    from lab.checks.h200_api_check import where_time_goes
    from minisgl.bench.workloads import Workload

    llm = make_llm(TINY_QWEN3_ASSET)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                             structured_output=StructuredOutput("json_object"))]
    where = where_time_goes(llm, Workload("w2_json", [[1, 2, 3, 4]], params))
    assert where["steps"] >= 6 and where["grammar_fill_ms"] > 0 and where["sample_processed_ms"] > 0
    assert where["launch_ms"] + where["wait_ms"] + where["schedule_ms"] <= where["step_ms"]
    assert "sample_processed" not in vars(llm.engine.runner) and "fill" not in vars(llm.engine.grammars())
    plain = where_time_goes(llm, Workload("w2", [[1, 2, 3, 4]], [SamplingParams(temperature=0, max_tokens=6)]))
    assert plain["grammar_fill_ms"] == 0 and plain["sample_processed_ms"] == 0
