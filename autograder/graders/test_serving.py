"""Notebook 11: the per-step message between the engine process and the front. Requests of random lengths finish
at random steps (some aborted with no last token, some failing); every token reaches its handle exactly once and in
order, every request's outcome arrives once and last, and nothing is left behind on either side."""

from __future__ import annotations

import random
from types import SimpleNamespace

import adapters
import pytest


class Handle:
    def __init__(self) -> None:
        self.tokens, self.finishes, self.extras = [], [], []

    def deliver(self, tokens, finish, extras) -> None:
        assert not self.finishes, "news after the request ended"
        self.tokens += tokens
        self.extras += (extras or {}).get("logprobs", [])
        if finish is not None:
            self.finishes.append(finish)


@pytest.mark.parametrize("seed", range(6))
def test_every_token_once_in_order_and_one_outcome(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    reqs = {rid: SimpleNamespace(output_ids=[], logprobs=[], finished=False, finish_reason=None, error=None,
                                 length=rng.randint(0, 9), ending=rng.choice(["length", "stop", "abort", "error"]))
            for rid in rng.sample(range(100), n)}
    live, sent = dict(reqs), {rid: 0 for rid in reqs}
    handles = {rid: Handle() for rid in reqs}
    front = dict(handles)
    for step in range(1, 40):
        for r in reqs.values():
            if r.finished:
                continue
            for _ in range(rng.randint(0, 2)):  # an overlap step may resolve more than one token
                if len(r.output_ids) < r.length:
                    r.output_ids.append(rng.randrange(1000))
                    r.logprobs.append(-rng.random())
            if len(r.output_ids) >= r.length and rng.random() < 0.5:
                r.finished, r.finish_reason = True, r.ending
        msg = adapters.collect_outputs(step, live, sent, ("logprobs",))
        assert msg.step == step and len(msg.rids) == len(set(msg.rids))
        assert all(rid not in live for rid, f in zip(msg.rids, msg.finishes) if f is not None)
        adapters.fan_out(msg, front)
    for rid, r in reqs.items():
        h = handles[rid]
        assert h.tokens == r.output_ids and h.extras == r.logprobs, rid
        if r.finished:
            assert len(h.finishes) == 1 and h.finishes[0].reason == r.ending
            assert rid not in live and rid not in sent and rid not in front
            if r.ending == "error":
                assert h.finishes[0].kind == "internal" and h.finishes[0].error
        else:
            assert not h.finishes and rid in live and rid in front


def test_fan_out_skips_departed_handles():
    msg, finish = adapters.step_outputs(3)
    msg.append(1, [4, 5])
    msg.append(2, [], finish("abort"))
    h = Handle()
    assert adapters.fan_out(msg, {1: h}) == 1 and h.tokens == [4, 5]
