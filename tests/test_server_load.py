"""Load: 72 concurrent streaming clients on 127.0.0.1, a seeded share of them hanging up at random points.

Every request that completes must carry exactly the offline greedy result (`minisgl.LLM`, same model, same
engine settings): the same text and the same number of tokens. Every one that hangs up must be aborted
by the server. Afterwards the engine must be idle with every KV page back in the pool (free or held by
the prefix cache, evictable), and the server must still answer.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from minisgl.server import ServerThread, build_state
from minisgl.server.testing import tiny_model_path

NUM_CLIENTS = 72
DISCONNECT_SHARE = 0.3
SEED = 20240607
# A small running set and KV pool so requests queue, share prefixes and compete for pages.
ENGINE_KW = {"kv_cache_tokens": 2048, "max_running_requests": 16, "page_size": 4}

WORDS = ("the server streams tokens to many clients while the engine batches their requests and the "
         "cache keeps shared prefixes caf\u00e9 na\u00efve \u65e5\u672c \U0001f600 numbers 0123456789").split()
PREFIXES = ["You are a helpful assistant. ", "Summarise the following text: ", "Translate into French: "]


def make_workload(rng: random.Random):
    prompts = [rng.choice(PREFIXES) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
               for _ in range(24)]
    clients = []
    for i in range(NUM_CLIENTS):
        clients.append({
            "id": i,
            "prompt": rng.choice(prompts),
            "chat": rng.random() < 0.35,
            "max_tokens": rng.randint(6, 40),
            "hang_up_after": rng.randint(0, 12) if rng.random() < DISCONNECT_SHARE else None,
            "delay": rng.random() * 0.5,
        })
    return clients


async def run_client(client: httpx.AsyncClient, c: dict) -> dict:
    await asyncio.sleep(c["delay"])
    if c["chat"]:
        url = "/v1/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": c["prompt"]}]}
    else:
        url = "/v1/completions"
        body = {"model": "tiny", "prompt": c["prompt"]}
    body.update(max_tokens=c["max_tokens"], temperature=0, stream=True, stream_options={"include_usage": True})
    text, usage, finish, events = [], None, None, 0
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if c["hang_up_after"] is not None and events >= c["hang_up_after"]:
                return {"status": "hung_up", "events": events}  # leaving the block closes the connection
            events += 1
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") if c["chat"] else choice["text"]
                text.append(piece or "")
                finish = choice["finish_reason"] or finish
    return {"status": "completed", "text": "".join(text), "usage": usage, "finish_reason": finish}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model_path(tmp_path_factory.getbasetemp() / "server-tests")


def test_load_with_disconnects(model_path):
    from minisgl import LLM, SamplingParams

    clients = make_workload(random.Random(SEED))

    # the offline greedy reference, on its own engine with the same settings
    llm = LLM(model_path, **ENGINE_KW)
    tok = llm.tokenizer

    def prompt_ids(c):
        if c["chat"]:
            text = tok.apply_chat_template([{"role": "user", "content": c["prompt"]}], tokenize=False,
                                           add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(c["prompt"], add_special_tokens=False)

    refs = llm.generate([prompt_ids(c) for c in clients],
                        [SamplingParams(temperature=0, max_tokens=c["max_tokens"]) for c in clients])
    del llm

    state = build_state(model_path, served_model_name="tiny", **ENGINE_KW)
    with ServerThread(state) as srv:
        async def main():
            limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS + 8)
            async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client:
                return await asyncio.gather(*(run_client(client, c) for c in clients))

        t0 = time.monotonic()
        results = asyncio.run(main())
        elapsed = time.monotonic() - t0

        completed = hung_up = 0
        for c, res, ref in zip(clients, results, refs):
            if res["status"] == "hung_up":
                hung_up += 1
                continue
            completed += 1
            assert res["text"] == ref.text, (c, res, ref)
            assert res["usage"]["completion_tokens"] == len(ref.token_ids), (c, res, ref)
            assert res["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
            assert res["finish_reason"] == ref.finish_reason

        # every hung-up request is aborted or had already finished; then the engine goes idle
        deadline = time.monotonic() + 30
        while True:
            s = state.engine.stats(check=True).result(timeout=10)
            if not s["has_work"] and s["active_handles"] == 0:
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.05)
        leaked = s["kv_pages_capacity"] - s["kv_pages_free"] - s["kv_pages_evictable"]
        print(f"\n[load] clients={NUM_CLIENTS} completed={completed} hung_up={hung_up} "
              f"aborted_by_server={s['aborted']} finished_by_engine={s['finished']} "
              f"pages_leaked={leaked} capacity={s['kv_pages_capacity']} engine_steps={s['engine_steps']} "
              f"time={elapsed:.1f}s")
        assert completed + hung_up == NUM_CLIENTS
        assert completed >= NUM_CLIENTS // 2 and hung_up >= 8
        assert 1 <= s["aborted"] <= hung_up
        assert s["finished"] + s["aborted"] == NUM_CLIENTS
        assert s["running"] == 0 and s["waiting"] == 0
        assert leaked == 0 and s["kv_pages_leaked"] == 0
        assert s.get("cache_check", "ok") == "ok", s  # the prefix cache's invariants, checked in the engine

        # still serving
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": clients[0]["prompt"],
                                                          "max_tokens": clients[0]["max_tokens"],
                                                          "temperature": 0}, timeout=60)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == refs[0].text
