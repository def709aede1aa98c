"""Stop conditions (EOS, stop_token_ids, max_tokens, stop strings) and aborting requests."""

from __future__ import annotations

import os

import pytest
from helpers import MAX_NEW, PROMPTS, TINY_QWEN3_ASSET, assert_all_pages_back, copy_model, hf_greedy

from minisgl import SamplingParams
from minisgl.scheduler import ReqStatus

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])


def first_new_token(seq: list[int], min_index: int) -> tuple[int, int]:
    """(index, token) of the first token at index >= min_index that does not occur before it."""
    for i in range(min_index, len(seq)):
        if seq[i] not in seq[:i]:
            return i, seq[i]
    raise AssertionError(f"no fresh token in {seq}")


# --- EOS from generation_config (a list) -------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_setup(qwen3_path, tmp_path_factory):
    """A copy of the Qwen3 checkpoint whose generation_config lists two EOS ids, each a token that greedy
    decoding of one prompt first emits mid-way."""
    refs = hf_greedy(qwen3_path, PROMPTS)
    i_a, tok_a = first_new_token(refs[0], 4)
    # a prompt whose output does not contain tok_a, with a fresh token of its own after a few steps
    j = next(j for j in range(1, len(PROMPTS)) if tok_a not in refs[j] and first_new_token(refs[j], 9)[1] != tok_a)
    i_b, tok_b = first_new_token(refs[j], 9)
    path = str(tmp_path_factory.mktemp("eos") / "qwen3-eos")
    copy_model(qwen3_path, path, generation_config={"eos_token_id": [tok_a, tok_b], "bos_token_id": 1})
    return dict(path=path, refs=refs, a=(0, i_a, tok_a), b=(j, i_b, tok_b))


@OVERLAP
def test_eos_list_from_generation_config_stops(overlap, eos_setup, make_llm):
    llm = make_llm(eos_setup["path"], overlap=overlap, page_size=4)
    assert set(llm.engine.model_config.eos_token_ids) == {eos_setup["a"][2], eos_setup["b"][2]}
    refs = eos_setup["refs"]
    prompts = [PROMPTS[eos_setup["a"][0]], PROMPTS[eos_setup["b"][0]]] + PROMPTS[1:6]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    for out, (row, index, tok) in zip(outs, (eos_setup["a"], eos_setup["b"])):
        assert out.token_ids == refs[row][:index + 1], "must stop right after the first EOS, keeping it"
        assert out.token_ids[-1] == tok and out.finish_reason == "stop"
    eos = {eos_setup["a"][2], eos_setup["b"][2]}
    for out, p in zip(outs[2:], prompts[2:]):
        ref = hf_greedy(eos_setup["path"], [p])[0]
        k = next((i for i, t in enumerate(ref) if t in eos), None)
        assert out.token_ids == (ref if k is None else ref[:k + 1])
        assert out.finish_reason == ("length" if k is None else "stop")
    assert_all_pages_back(llm)
    # ignore_eos runs through
    outs = llm.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outs] == [refs[eos_setup["a"][0]], refs[eos_setup["b"][0]]]
    assert all(o.finish_reason == "length" for o in outs)


def test_eos_from_config_json_without_generation_config(qwen3_path, tmp_path, make_llm):
    ref = hf_greedy(qwen3_path, [PROMPTS[2]])[0]
    i, tok = first_new_token(ref, 3)
    path = copy_model(qwen3_path, str(tmp_path / "m"))
    os.remove(os.path.join(path, "generation_config.json"))
    import json
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = tok
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    llm = make_llm(path)
    assert llm.engine.model_config.eos_token_ids == (tok,)
    (out,) = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert out.token_ids == ref[:i + 1] and out.finish_reason == "stop"


# --- stop_token_ids and max_tokens -------------------------------------------------------------------------

@OVERLAP
def test_stop_token_ids(overlap, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, overlap=overlap)
    refs = hf_greedy(qwen3_path, PROMPTS[:8])
    params, expect = [], []
    for ref in refs:
        i, tok = first_new_token(ref, 2)
        # stop_token_ids apply even with ignore_eos (they are the user's, not the model's)
        params.append(SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[tok, 0]))
        expect.append(ref[:i + 1] if 0 not in ref[:i] else None)
    outs = llm.generate(PROMPTS[:8], params)
    for out, exp in zip(outs, expect):
        if exp is not None:
            assert out.token_ids == exp and out.finish_reason == "stop"
    assert_all_pages_back(llm)


@OVERLAP
def test_max_tokens(overlap, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, overlap=overlap, page_size=4)
    refs = hf_greedy(qwen3_path, PROMPTS[:6])
    for m in (1, 2, 5):
        outs = llm.generate(PROMPTS[:6], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        assert [o.token_ids for o in outs] == [r[:m] for r in refs]
        assert all(o.finish_reason == "length" for o in outs)
    # the engine never computes more than it returns: max_tokens=1 needs a single (prefill) step
    llm2 = make_llm(qwen3_path, overlap=overlap)
    llm2.generate(PROMPTS[:6], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert llm2.engine.stats["steps"] == 1


# --- stop strings ------------------------------------------------------------------------------------------

@OVERLAP
def test_stop_strings_trim_the_text(overlap, qwen3_tok_path, make_llm):
    """With a word-level tokenizer (token i <-> "w{i}"), a stop string ends generation at the token that
    completes it, and the text is cut before it."""
    llm = make_llm(qwen3_tok_path, overlap=overlap)
    tok = llm.tokenizer
    assert tok is not None
    prompt = PROMPTS[4]
    ref = hf_greedy(qwen3_tok_path, [prompt])[0]
    full_text = tok.decode(ref)
    (plain,) = llm.generate([prompt], GREEDY)
    assert plain.text == full_text and plain.token_ids == ref

    # a one-token stop string, and one spanning two tokens (needs the decoded window, not one token)
    i, t = next((i, t) for i, t in enumerate(ref) if i >= 3 and f"w{t}" not in tok.decode(ref[:i]))
    two = tok.decode(ref[10:12])
    for stop in (f"w{t}", two, [two, f"w{t}"]):
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=stop)
        stops = [stop] if isinstance(stop, str) else stop
        k = next(k for k in range(len(ref)) if any(s in tok.decode(ref[:k + 1]) for s in stops))
        (out,) = llm.generate([prompt], params)
        assert out.finish_reason == "stop"
        assert out.token_ids == ref[:k + 1]
        cut = min(full_text.find(s) for s in stops if s in full_text)
        assert out.text == full_text[:cut]
        assert not any(s in out.text for s in stops)
    # text prompts go through the tokenizer
    (out,) = llm.generate([tok.decode(prompt)], GREEDY)
    assert out.prompt_token_ids == prompt and out.token_ids == ref
    assert_all_pages_back(llm)


def test_stop_strings_need_a_tokenizer(qwen3_path, make_llm):
    llm = make_llm(qwen3_path)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([PROMPTS[0]], SamplingParams(stop="x"))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("some text", SamplingParams())
    (out,) = llm.generate([PROMPTS[0]], GREEDY)
    assert out.text is None and len(out.token_ids) == MAX_NEW


@pytest.mark.skipif(not os.path.isdir(TINY_QWEN3_ASSET),
                    reason="assets/tiny-qwen3/ (the trained tiny model with a real tokenizer) is not there yet")
def test_stop_strings_with_the_embedded_tiny_qwen3(make_llm):
    llm = make_llm(TINY_QWEN3_ASSET, dtype="float32")
    tok = llm.tokenizer
    assert tok is not None
    prompt = "The function returns"
    (plain,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert plain.prompt_token_ids == tok.encode(prompt, add_special_tokens=False)
    assert plain.text == tok.decode(plain.token_ids, skip_special_tokens=True)
    # a stop string taken from the middle of the greedy text
    mid = len(plain.text) // 2
    stop = plain.text[mid:mid + 4]
    assert stop, plain.text
    cut = plain.text.find(stop)
    k = next(k for k in range(len(plain.token_ids))
             if stop in tok.decode(plain.token_ids[:k + 1], skip_special_tokens=True))
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.token_ids == plain.token_ids[:k + 1]
    assert out.text == plain.text[:cut] and stop not in out.text
    assert_all_pages_back(llm)


# --- abort -------------------------------------------------------------------------------------------------

@OVERLAP
@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_running_request_frees_its_pages(overlap, page_size, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, overlap=overlap, page_size=page_size)
    engine = llm.engine
    refs = hf_greedy(qwen3_path, PROMPTS[:4])
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS[:4]]
    victim = reqs[1]
    while len(victim.output_ids) < 5:
        engine.step()
    assert victim.status is ReqStatus.RUNNING and victim.pages and victim.row is not None
    def held():  # pages held by requests: neither free nor (unlocked) in the prefix cache
        return engine.allocator.capacity - engine.allocator.num_free - engine.cache.evictable_pages

    held_before, victim_pages = held(), len(victim.pages)
    engine.abort(victim)
    assert victim.finished and victim.finish_reason == "abort"
    # its pages come back as soon as no launched step uses them: within two steps
    for _ in range(2):
        engine.step()
    assert victim.row is None and victim.pages == [] and victim.released
    assert victim not in engine.scheduler.running
    # the others grew by at most two pages each meanwhile
    assert held() <= held_before - victim_pages + 2 * (len(reqs) - 1)
    n_out = len(victim.output_ids)
    assert n_out < MAX_NEW
    engine.run()
    assert len(victim.output_ids) == n_out, "an aborted request must not get more tokens"
    assert victim.output_ids == refs[1][:n_out]
    for r, ref in zip(reqs, refs):
        if r is not victim:
            assert r.output_ids == ref and r.finish_reason == "length"
    assert_all_pages_back(llm)
    engine.abort(victim)  # aborting a finished request is a no-op
    assert victim.finish_reason == "abort"


def test_abort_waiting_request(qwen3_path, make_llm):
    llm = make_llm(qwen3_path, max_running_requests=1)
    engine = llm.engine
    a = engine.add_request(PROMPTS[0], GREEDY)
    b = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    assert a.status is ReqStatus.RUNNING and b.status is ReqStatus.WAITING
    engine.abort(b)
    assert b.finish_reason == "abort" and b not in engine.scheduler.waiting
    assert b.released and b.finish_time is not None, "a waiting request holds nothing: released at once"
    engine.run()
    assert b.output_ids == [] and b.pages == [] and b.row is None
    assert a.output_ids == hf_greedy(qwen3_path, [PROMPTS[0]])[0]
    assert_all_pages_back(llm)


@OVERLAP
def test_abort_everything_mid_prefill(overlap, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, overlap=overlap, chunked_prefill_size=7, page_size=4)
    engine = llm.engine
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS[:10]]
    engine.step()
    engine.step()
    for r in reqs:
        engine.abort(r)
    engine.run()
    assert all(r.finish_reason == "abort" and r.row is None and r.released for r in reqs)
    assert_all_pages_back(llm)
    # and the engine still serves requests correctly
    run = llm.generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in run] == hf_greedy(qwen3_path, PROMPTS[:3])


# --- the token table: sampled tokens reach the next step on the device --------------------------------------

@OVERLAP
def test_sampled_tokens_wait_in_the_token_table_at_row_and_position(overlap, qwen3_path, make_llm):
    """After every step, a running request's row of the token-id table holds its known tokens at their
    positions and, under overlap, the token the host has not read yet at the next position; that token is the
    one the request later receives. The batch carries no token ids at all."""
    llm = make_llm(qwen3_path, overlap=overlap, page_size=4, chunked_prefill_size=7, radix_cache=False)
    engine = llm.engine
    table = engine.runner.req_pool.token_ids
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS[:5]]
    unread = {}  # (request, position) -> the id the table held before the host read it
    while engine.has_work:
        engine.step()
        for r in engine.scheduler.running:
            if r.finished:
                continue
            row = table[r.row, :r.num_tokens].tolist()
            known = r.input_ids + r.output_ids
            assert row[:len(known)] == known, "every known token sits at its position"
            unread.update({(r.rid, pos): row[pos] for pos in range(len(known), r.num_tokens)})
    assert bool(unread) == overlap, "only the overlap loop schedules a step before reading the previous one"
    for (rid, pos), token in unread.items():
        r = reqs[rid]
        assert (r.input_ids + r.output_ids)[pos] == token
    assert [r.output_ids for r in reqs] == hf_greedy(qwen3_path, PROMPTS[:5])
    assert not hasattr(engine.runner, "last_tokens")


@pytest.mark.parametrize("cache_kv", [True, False], ids=["cache", "no-cache"])
def test_release_without_caching_adds_nothing_to_the_prefix_cache(cache_kv, qwen3_path, make_llm):
    """`release(cache_kv=False)` (the failure path) gives the pages back without inserting the request's KV:
    after a failed step it may cover a token the host never received."""
    llm = make_llm(qwen3_path, page_size=4, overlap=False)  # nothing in flight between steps
    engine, sched = llm.engine, llm.engine.scheduler
    r = engine.add_request(PROMPTS[1], GREEDY)
    while len(r.output_ids) < 10:
        engine.step()
    cached, free = engine.cache.cached_pages, engine.allocator.num_free
    held = len(r.pages) - r.cached_len // 4
    assert r.kv_len // 4 > r.cached_len // 4, "decoding filled pages the cache does not hold yet"
    sched.release(r, cache_kv=cache_kv)
    sched.running.remove(r)
    r.status = ReqStatus.RELEASED
    if cache_kv:
        assert engine.cache.cached_pages > cached
    else:
        assert engine.cache.cached_pages == cached and engine.allocator.num_free == free + held
    assert r.row is None and r.pages == [] and r.cache_node is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_one_table_write_per_position_when_a_chunk_joins_a_cached_prefix(page_size, qwen3_path, make_llm):
    """Two requests with the same prompt prefilled in the same step: the second's new positions are pointed at
    the first's pages as soon as the first caches them, and no (row, position) is written twice in the step
    (a scatter that writes an index twice has no defined winner on a GPU; on a CPU the last one wins)."""
    llm = make_llm(qwen3_path, page_size=page_size, overlap=False)
    engine, pool = llm.engine, llm.engine.runner.req_pool
    prompt = PROMPTS[12]
    a, b = (engine.add_request(prompt, GREEDY) for _ in range(2))
    batch = engine.scheduler.schedule()
    assert batch.reqs == [a, b] and batch.extend_lens == [len(prompt)] * 2
    full = (len(prompt) // page_size) * page_size
    assert b.pages[:full // page_size] == a.pages[:full // page_size], "b points at a's pages"
    writes = list(zip(pool._rows, pool._cols))
    assert len(writes) == len(set(writes)), "a position written twice in one step"
    engine._resolve(engine._launch(batch))
    engine.run()
    assert a.output_ids == b.output_ids == hf_greedy(qwen3_path, [prompt])[0]


# --- a smaller prefill budget in steps that decode (mixed_prefill_tokens) ----------------------------------
@OVERLAP
def test_mixed_prefill_tokens_bounds_prefill_in_decoding_steps(overlap, qwen3_path, make_llm):
    """With mixed_prefill_tokens=16 a step that decodes carries at most 16 prompt tokens, a step without decode
    rows still the full chunk (64); the tokens are the same as without the bound."""
    short, long = [5, 6, 7], [(11 * i) % 400 + 3 for i in range(150)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    ref = make_llm(qwen3_path, overlap=overlap, chunked_prefill_size=64).generate([short, long], params)
    llm = make_llm(qwen3_path, overlap=overlap, chunked_prefill_size=64, mixed_prefill_tokens=16)
    steps = []
    forward = llm.engine.runner.forward

    def record(batch):
        prefill = sum(n for r, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)
                      if start < len(r.input_ids))
        steps.append((prefill, len(batch.reqs) - sum(start < len(r.input_ids)
                                                     for r, start in zip(batch.reqs, batch.prefix_lens))))
        return forward(batch)
    llm.engine.runner.forward = record
    outs = llm.generate([short, long], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert steps[0] == (64, 0), steps[:3]  # nothing decodes yet: the whole chunk (3 + 61 tokens)
    mixed = [p for p, decodes in steps if decodes and p]
    assert mixed and max(mixed) <= 16, steps
    assert sum(p for p, _ in steps) == len(short) + len(long)
    assert_all_pages_back(llm)


def _two_prefills_under_way(second_prompt: int, second_done: int):
    """A scheduler (page size 4, no prefix cache) with two prefills under way, A (30 tokens, 8 computed: its two
    pages full) and B (`second_prompt` tokens, `second_done` computed, in one page), and every other page held
    outside it (`hog`)."""
    from minisgl.kvcache import NaiveCache, PageAllocator, ReqToTokenPool
    from minisgl.scheduler import Req, Scheduler

    alloc = PageAllocator(40)
    s = Scheduler(alloc, ReqToTokenPool(max_reqs=8, max_context_len=128, device="cpu"), NaiveCache(alloc, 4), 4,
                  max_running=4, chunk_size=8)
    a = Req(0, list(range(100, 130)), SamplingParams(temperature=0, max_tokens=2), seed=0)
    b = Req(1, list(range(200, 200 + second_prompt)), SamplingParams(temperature=0, max_tokens=2), seed=1)
    s.add(a)
    s.add(b)
    assert s._admit(a, 0) == 8
    s._build([(a, 8)])
    s.chunk_size = second_done
    assert s._admit(b, 0) == second_done
    s._build([(b, second_done)])
    s.chunk_size = 64
    hog = alloc.alloc(alloc.num_free)
    return s, a, b, hog


def _resolve(batch) -> None:
    """A fake model's step: every sampling request gets token 7."""
    for row in batch.sample_rows:
        req = batch.reqs[row]
        req.num_pending -= 1
        req.output_ids.append(7)
        if len(req.output_ids) >= req.params.max_tokens:
            req.status = ReqStatus.FINISHED


def _finish(s, batch, hog) -> None:
    """Resolve `batch`, give the held pages back and run the scheduler to the end."""
    _resolve(batch)
    s.allocator.free(hog)
    for _ in range(50):
        s.release_finished(set())
        if not s.has_work:
            break
        batch = s.schedule()
        if batch is not None:
            _resolve(batch)
    assert not s.has_work
    assert s.allocator.num_free == s.allocator.capacity


def test_a_prefill_short_of_pages_does_not_hold_up_one_that_needs_none():
    """The engine fuzzer's stall (seed 20261208, Qwen3.5): the first prefill under way could not get its chunk's
    pages and the scheduler stopped there, never reaching a second one whose chunk fit in the page it held, and
    the engine raised 'scheduler stalled'. Now the first takes what fits (here nothing) and the second runs."""
    s, a, b, hog = _two_prefills_under_way(4, 2)  # B's last 2 tokens fit in its one page
    batch = s.schedule()
    assert batch is not None and batch.reqs == [b] and batch.extend_lens == [2]
    assert s.num_retractions == 0
    _finish(s, batch, hog)
    assert a.output_ids == [7, 7] and b.output_ids == [7, 7]


def test_a_prefill_takes_the_chunk_the_free_pages_allow():
    s, a, b, hog = _two_prefills_under_way(4, 2)
    s.allocator.free(hog[:2])  # two pages: A may grow from 8 tokens to 16
    batch = s.schedule()
    assert batch.reqs == [a, b] and batch.extend_lens == [8, 2]
    _finish(s, batch, hog[2:])


def test_prefills_that_hold_the_pool_between_them_retract_the_newest():
    """Two prefills under way, each needing a page, none free and none to evict: nothing could run again. The
    newest is retracted (as a decoder short of pages would be), and the oldest goes on in the page it gave back."""
    s, a, b, hog = _two_prefills_under_way(20, 4)
    batch = s.schedule()
    assert batch is not None and batch.reqs == [a] and batch.extend_lens == [4]
    assert b.num_retractions == 1 and a.num_retractions == 0 and list(s.waiting) == [b] and b.pages == []
    _finish(s, batch, hog)
    assert a.output_ids == [7, 7] and b.output_ids == [7, 7]
