"""Tensor parallelism on a CPU (gloo, fp32): TP=2 and TP=4 give the tokens of TP=1 and Hugging Face, and the
rank processes start and stop cleanly (a dead rank ends the engine with a clear error, nothing is left behind).

Each engine spawns tp_size - 1 processes, each importing torch: a few seconds per engine on a small machine,
so the prompts are few and short.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import PROMPTS, assert_parity, hf_greedy

from minisgl import LLM, SamplingParams

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# independent prompts and a group sharing a 24-token prefix (radix hits), 1..60 tokens
TP_PROMPTS = [PROMPTS[i] for i in (0, 1, 3, 12, 13, 14)]
SWITCHES = dict(dtype="float32", chunked_prefill_size=7, page_size=4, radix_cache=True)


def child_pids() -> set[int]:
    """Live (non-zombie) processes whose parent is this one, except multiprocessing's resource tracker (one
    per interpreter, started by the first spawn; it exits with the interpreter)."""
    me, out = os.getpid(), set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and "resource_tracker" not in cmd:
            out.add(int(d))
    return out


@pytest.fixture
def no_leftover_processes():
    before = child_pids()
    yield
    assert child_pids() <= before, f"processes left behind: {child_pids() - before}"


def _generate_twice(llm, prompts):
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)  # every prompt now hits the radix cache
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert all(o.num_cached_prompt_tokens > 0 for o in again if len(o.prompt_token_ids) > 4)
    return first


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_tp_greedy_equals_tp1_and_hf(arch, tp, arch_paths, make_llm, no_leftover_processes):
    path = arch_paths[arch]
    ref = make_llm(path, **SWITCHES).generate(TP_PROMPTS, GREEDY)
    llm = make_llm(path, tp_size=tp, **SWITCHES)
    runner = llm.engine.runner
    # 4 query heads, 2 K/V heads: TP=2 splits the K/V heads, TP=4 replicates each on two ranks
    assert (runner.num_q_heads, runner.num_kv_heads) == (4 // tp, 1 if tp == 4 else 2 // tp)
    assert runner.kv_cache.buffer.shape[-2] == runner.num_kv_heads
    outs = _generate_twice(llm, TP_PROMPTS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert_parity(outs, hf_greedy(path, TP_PROMPTS, MAX_NEW), TP_PROMPTS)
    llm.close()
    assert not runner.tp.procs[0].is_alive()


def test_tp_vocab_not_divisible(tmp_path, make_llm, no_leftover_processes):
    """A vocabulary of 509 over two ranks: the last shard is zero-padded and the padding never sampled."""
    import torch
    from helpers import tiny_hf_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config("qwen3", tie=False)
    cfg.vocab_size = 509
    torch.manual_seed(5)
    path = str(tmp_path / "qwen3-509")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    prompts = [[t % 509 for t in p] for p in TP_PROMPTS[:3]]
    ref = make_llm(path, **SWITCHES).generate(prompts, GREEDY)
    llm = make_llm(path, tp_size=2, **SWITCHES)
    outs = llm.generate(prompts, GREEDY)
    llm.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert_parity(outs, hf_greedy(path, prompts, MAX_NEW), prompts)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_tp_step_of_mid_prompt_chunks_only(overlap, qwen3_path, make_llm, no_leftover_processes):
    """One 40-token prompt cut into chunks of 13: the first three steps hold only mid-prompt chunks, so no row
    needs logits and the vocab-parallel LM head gets 0 rows on every rank (issue 28: it raised, every rank
    stopped). The tokens are TP=1's and Hugging Face's, and every page comes back (make_llm checks)."""
    prompt = [PROMPTS[1][i % len(PROMPTS[1])] for i in range(40)]
    switches = dict(dtype="float32", chunked_prefill_size=13, page_size=4, overlap=overlap)
    ref = make_llm(qwen3_path, **switches).generate([prompt], GREEDY)
    llm = make_llm(qwen3_path, tp_size=2, **switches)
    steps_before = llm.engine.stats["steps"]
    (out,) = llm.generate([prompt], GREEDY)
    assert llm.engine.stats["steps"] - steps_before >= 3 + MAX_NEW - 1  # 13 + 13 + 13 + 1, then decodes
    assert out.token_ids == ref[0].token_ids
    assert_parity([out], hf_greedy(qwen3_path, [prompt], MAX_NEW), [prompt])
    assert [o.token_ids for o in llm.generate([prompt, prompt[:7]], GREEDY)][0] == out.token_ids  # serves on
    llm.close()


def test_tp_refuses_a_hybrid_model_by_name(tmp_path, no_leftover_processes):
    """Qwen3.5 runs at TP 1; at TP 2 the message says tensor parallelism does not run hybrid models (it used to
    say "unsupported architecture"), before any rank process starts."""
    from test_qwen35 import tiny_text_config
    from transformers import Qwen3_5ForCausalLM

    path = str(tmp_path / "qwen3.5")
    Qwen3_5ForCausalLM(tiny_text_config()).save_pretrained(path)  # architectures: ["Qwen3_5ForCausalLM"]
    assert LLM(path, dtype="float32").generate([[5, 6, 7]], GREEDY)[0].token_ids  # runs at TP 1
    with pytest.raises(ValueError, match=r"tensor parallelism does not run linear_state models \(such as qwen3_5\)"):
        LLM(path, dtype="float32", tp_size=2)


@pytest.mark.parametrize("tp, match", [(3, "must divide the model's 4 query heads"), (0, "tp_size must be")])
def test_tp_size_validated_before_any_process_starts(qwen3_path, tp, match, no_leftover_processes):
    with pytest.raises(ValueError, match=match):
        LLM(qwen3_path, dtype="float32", tp_size=tp)


def test_tp_rank_failing_at_start_stops_everything(qwen3_path, no_leftover_processes):
    # flashinfer does not run on a CPU: every rank fails after loading; rank 0 stops the others
    with pytest.raises((ValueError, RuntimeError, ImportError)):
        LLM(qwen3_path, dtype="float32", tp_size=2, attention_backend="flashinfer")


def test_tp_dead_rank_ends_engine_with_clear_error(qwen3_path, make_llm, no_leftover_processes):
    llm = make_llm(qwen3_path, tp_size=2, **SWITCHES)
    assert len(llm.generate(TP_PROMPTS[:2], GREEDY)[0].token_ids) == MAX_NEW
    worker = llm.engine.runner.tp.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate(TP_PROMPTS[:2], GREEDY)
    assert not worker.is_alive()
    with pytest.raises(RuntimeError, match="rank 1"):  # the engine stays stopped, and says why
        llm.generate(TP_PROMPTS[:1], GREEDY)
    llm.close()


def test_tp_ranks_exit_when_rank0_is_killed(qwen3_path, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from minisgl import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({qwen3_path!r}, dtype="float32", tp_size=2)
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
            print(*[p.pid for p in llm.engine.runner.tp.procs], flush=True)
            time.sleep(600)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert pids, "rank 0 did not start"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids):
        assert time.monotonic() < deadline, f"ranks {pids} outlived rank 0"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_tp_server(no_leftover_processes, tmp_path_factory):
    import httpx

    from minisgl.server import ServerThread, build_state
    from minisgl.server.testing import tiny_model_path

    path = tiny_model_path(tmp_path_factory.getbasetemp() / "server-tests")
    ref = LLM(path, kv_cache_tokens=4096).generate("Numbers 0123", SamplingParams(temperature=0, max_tokens=16))[0]
    srv = ServerThread(build_state(path, served_model_name="tiny", kv_cache_tokens=4096, tp_size=2)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Numbers 0123", "max_tokens": 16,
                                                   "temperature": 0}).json()
    finally:
        srv.stop()
    assert r["choices"][0]["text"] == ref.text


def test_head_split_and_vocab_range():
    """Which heads and vocabulary rows each rank keeps (no processes)."""
    from dataclasses import astuple

    from helpers import tiny_hf_config

    from minisgl.distributed.shard import check_tp_size, head_split, vocab_range
    from minisgl.models import ModelConfig

    cfg = ModelConfig.from_hf(tiny_hf_config("qwen3"))  # 4 query heads, 2 K/V heads
    assert [astuple(head_split(cfg, r, 2)) for r in range(2)] == [(2, 0, 1, 0), (2, 2, 1, 1)]
    # 4 ranks, 2 K/V heads: ranks 0, 1 share K/V head 0 (their query heads 0, 1 read it), ranks 2, 3 head 1
    assert [(s.q_start, s.kv_start, s.num_kv) for s in (head_split(cfg, r, 4) for r in range(4))] == [
        (0, 0, 1), (1, 0, 1), (2, 1, 1), (3, 1, 1)]
    group = cfg.num_q_heads // cfg.num_kv_heads
    for tp in (1, 2, 4):
        for r in range(tp):
            s = head_split(cfg, r, tp)
            assert {q // group for q in range(s.q_start, s.q_start + s.num_q)} <= set(
                range(s.kv_start, s.kv_start + s.num_kv))
    with pytest.raises(ValueError, match="query heads"):
        check_tp_size(cfg, 3)
    assert [vocab_range(509, r, 2) for r in range(2)] == [(0, 255, 255), (255, 509, 255)]
    assert [vocab_range(10, r, 4) for r in range(4)] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]
