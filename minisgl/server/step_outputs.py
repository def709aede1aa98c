# generated from notebooks/11_serving.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/11_serving.ipynb, cell 3 (id c11-003) ---
"""The engine's one message per step, and its two ends: collected in the engine process, fanned out in the front.

The engine process runs the step loop; the front process (HTTP, tokenizer, detokenizer) holds one handle per
open request. After every step the engine sends **one** message for all requests that have news: the new token
ids of each, and the outcome of those that ended. One pickle of plain lists per step, not one message per token
per request: at 256 running streams that is 256 times fewer sends, pickles and wake-ups.

Per-token fields besides the token id (log-probabilities, say) ride along in `extras`: a name, and one list per
request parallel to its new tokens. `collect_outputs` slices them from the request the same way as the ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field


# --- notebooks/11_serving.ipynb, cell 7 (id c11-007) ---
@dataclass
class Finish:
    """How a request ended. `kind` says who is to blame when it failed: "invalid" (the engine refused it: a 400
    naming `param`), "unavailable" (the engine is gone or stopping: a 503) or "internal" (a bug: a 500)."""

    reason: str  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    kind: str | None = None
    param: str | None = None
    code: str | None = None


# --- notebooks/11_serving.ipynb, cell 8 (id c11-008) ---
@dataclass
class StepOutputs:
    """Everything one engine step has for the front, as parallel lists: request `rids[i]` has new tokens
    `tokens[i]` and, when it ended, `finishes[i]` (None while it runs)."""

    step: int  # engine steps so far
    rids: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    finishes: list[Finish | None] = field(default_factory=list)
    extras: dict[str, list[list]] = field(default_factory=dict)  # name -> per request, parallel to its tokens

    def append(self, rid: int, tokens: list[int], finish: Finish | None = None, **extras: list) -> None:
        self.rids.append(rid)
        self.tokens.append(tokens)
        self.finishes.append(finish)
        for name, values in self.extras.items():
            values.append(extras.get(name, []))

    def __len__(self) -> int:
        return len(self.rids)


# --- notebooks/11_serving.ipynb, cell 10 (id c11-010) ---
def collect_outputs(step: int, live: dict, sent: dict[int, int], per_token: tuple[str, ...] = ()) -> StepOutputs:
    """After an engine step: one entry for every request in `live` (rid -> Req) with tokens not sent yet, or
    that has finished. `sent[rid]` counts the tokens already sent and is moved forward; a finished request
    leaves `live` and `sent` (it is reported exactly once). `per_token` names Req lists parallel to
    `output_ids` (e.g. log-probabilities) that travel in `extras` under the same name."""
    out = StepOutputs(step, extras={name: [] for name in per_token})
    done = []
    for rid, req in live.items():
        start, end = sent[rid], len(req.output_ids)
        if start == end and not req.finished:
            continue
        finish = None
        if req.finished:
            reason = req.finish_reason or "stop"
            finish = Finish(reason, req.error or "the request failed in the engine", "internal") \
                if reason == "error" else Finish(reason)
            done.append(rid)
        out.append(rid, req.output_ids[start:end], finish,
                   **{name: getattr(req, name)[start:end] for name in per_token})
        sent[rid] = end
    for rid in done:
        del live[rid], sent[rid]
    return out


# --- notebooks/11_serving.ipynb, cell 13 (id c11-013) ---
def fan_out(msg: StepOutputs, handles: dict) -> int:
    """In the front: hand each request's news in `msg` to its handle (`handles`: rid -> an object with
    `deliver(tokens, finish, extras)`); a request whose news carries a Finish leaves `handles`. News for a rid
    with no handle (the client left, its handle is gone) is dropped. Returns how many handles got news."""
    delivered = 0
    names = tuple(msg.extras)
    for i, rid in enumerate(msg.rids):
        handle = handles.get(rid)
        if handle is None:
            continue
        finish = msg.finishes[i]
        handle.deliver(msg.tokens[i], finish, {n: msg.extras[n][i] for n in names} if names else None)
        delivered += 1
        if finish is not None:
            del handles[rid]
    return delivered
