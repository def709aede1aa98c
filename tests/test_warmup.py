"""The kernel warm-up at engine start (engine/warmup.py, issue 29): its switch, its plan of variants (pure
functions), and on a CPU that it is skipped, that its steps run the real model code on scratch inputs and that
they leave the engine's pools exactly as they found them. Compiling and the GPU timings: lab/checks/warmup.py."""

from __future__ import annotations

import argparse

import torch

from minisgl import SamplingParams
from minisgl.config import EngineConfig, add_engine_args, engine_kwargs_from_args, make_config
from minisgl.engine import warmup
from minisgl.engine.warmup import (
    eager_decode_sizes,
    eager_plan,
    mixed_decode_rows,
    prefill_requests,
    split_groups,
    variant_classes,
)
from minisgl.kernels.attention import decode_num_splits


def _class(n: int) -> tuple[bool, bool, int]:
    return n == 1, n % 16 == 0, n % 4


# --- the switch -----------------------------------------------------------------------------------------------


def test_switch_is_on_by_default_and_off_by_config_and_flag():
    assert EngineConfig("m").kernel_warmup
    assert not make_config("m", kernel_warmup=False).kernel_warmup
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs_from_args(p.parse_args(["--model", "m", "--disable-kernel-warmup"])) == {
        "kernel_warmup": False}
    assert "kernel_warmup" not in engine_kwargs_from_args(p.parse_args(["--model", "m"]))


def test_gc_freeze_switch_is_gpu_only_and_close_thaws(qwen3_path, make_llm):
    """The start-up's objects are frozen out of the garbage collector's walks (run16: collections cost the first
    W1 0.22-0.26 s) on a GPU only: on a CPU nothing is frozen (the suite builds hundreds of
    engines in one process), and a runner that froze thaws on close, so a closed engine's cycles are collectable."""
    import gc
    assert EngineConfig("m").gc_freeze and not make_config("m", gc_freeze=False).gc_freeze
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs_from_args(p.parse_args(["--model", "m", "--disable-gc-freeze"])) == {"gc_freeze": False}
    frozen = gc.get_freeze_count()
    llm = make_llm(qwen3_path)
    assert not llm.engine.runner.gc_frozen and gc.get_freeze_count() == frozen
    gc.freeze()  # as _setup does on a GPU
    llm.engine.runner.gc_frozen = True
    llm.close()
    assert gc.get_freeze_count() == 0 and not llm.engine.runner.gc_frozen


def test_startup_phases_are_recorded_in_order(qwen3_path, make_llm):
    """Where an engine's start-up time goes (issue 29: 36.6 s on a fresh H200 against a 30 s target): each phase's
    host seconds, in the order they ran, together no longer than the whole start."""
    import time
    t0 = time.perf_counter()
    llm = make_llm(qwen3_path)
    total = time.perf_counter() - t0
    phases = llm.engine.runner.startup
    assert list(phases) == ["device", "load", "pools", "gc_freeze", "kernel_warmup", "decode_graphs",
                            "prefill_graphs", "gc"]
    # each phase is rounded to the millisecond: together within half a millisecond each of the whole start
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= total + 0.0005 * len(phases)


# --- the plan -------------------------------------------------------------------------------------------------


def test_variant_classes_cover_each_class_once():
    sizes = range(1, 100)
    picked = variant_classes(sizes)
    assert picked == [1, 2, 3, 4, 5, 16]
    assert {_class(n) for n in picked} == {_class(n) for n in sizes}
    assert len({_class(n) for n in picked}) == len(picked)
    assert variant_classes([7]) == [7] and variant_classes([]) == []


def test_split_counts_of_a_model_and_card():
    # Hkv 8 (Qwen3-0.6B/8B) on 132 SMs (H200): ceil(2 * 132 / (8 * bs)) splits, at most 64, at least 1
    groups = split_groups(range(1, 257), 8, 40960, 132)
    assert sorted(groups) == [1, 2, 3, 4, 5, 6, 7, 9, 11, 17, 33]
    assert groups[33] == [1] and groups[1] == list(range(33, 257))
    # a short context caps the splits (no split under 256 tokens): 512 tokens, at most 2
    assert split_groups(range(1, 41), 8, 512, 132) == {2: list(range(1, 33)), 1: list(range(33, 41))}
    # Hkv 2 (Qwen3.5) on the same card: the 64-split cap binds at batch 1 and 2
    groups = split_groups(range(1, 257), 2, 262144, 132)
    assert max(groups) == 64 and groups[64] == [1, 2] and min(groups) == 1
    for splits, sizes in groups.items():
        assert all(decode_num_splits(bs, 2, 262144, 132) == splits for bs in sizes)


def test_mixed_decode_rows_cover_every_count():
    # n decode rows run as a batch of the next power of two: every (power, class) of 1..n_max has a representative
    def key(n):
        return 1 << (n - 1).bit_length(), _class(n)

    for n_max in (1, 2, 3, 7, 255, 300, 1023):
        rows = mixed_decode_rows(n_max)
        assert max(rows) <= n_max and len(set(rows)) == len(rows)
        assert {key(n) for n in rows} == {key(n) for n in range(1, n_max + 1)}
    assert mixed_decode_rows(0) == []
    assert mixed_decode_rows(8) == [1, 2, 3, 4, 5, 6, 7, 8]


def test_prefill_and_eager_decode_sizes():
    assert prefill_requests(256) == [1, 2, 3, 4, 5, 16, 256]
    assert prefill_requests(1) == [1]
    # graphs off: every split count's classes, the GEMV's 1..4 rows, the largest batch
    sizes = eager_decode_sizes(1, 40, 8, 512, 132)
    assert {1, 2, 3, 4, 40} <= set(sizes)
    for group in split_groups(range(1, 41), 8, 512, 132).values():
        assert {_class(n) for n in group} == {_class(n) for n in sizes if n in group}
    # above the largest graph (256) only
    assert min(eager_decode_sizes(257, 1024, 8, 40960, 132)) == 257
    assert eager_decode_sizes(257, 256, 8, 40960, 132) == []


def test_eager_plan():
    plan = eager_plan(max_rows=1024, prefill_budget=8192, max_model_len=40960, graph_max_bs=256, num_kv_heads=8,
                      max_context_len=40960, num_sms=132)
    assert len({s.label for s in plan}) == len(plan)
    decode = [s for s in plan if s.decode]
    assert decode and all(len(s.extend) > 256 and set(s.extend) == {1} for s in decode)
    assert max(len(s.extend) for s in decode) == 1024
    mixed = [s for s in plan if s.label.startswith("mixed")]
    assert [len(s.extend) - 1 for s in mixed] == mixed_decode_rows(1023)
    assert all(s.extend[-1] > 1 for s in mixed)  # one request prefilling: a mixed step, not a decode step
    assert max(sum(s.extend) for s in plan if not s.decode) == 8192
    # more than one request: more tokens than requests (a hybrid takes T == N for a decode step)
    assert all(sum(s.extend) > len(s.extend) for s in plan if not s.decode and len(s.extend) > 1)
    no_graphs = eager_plan(8, 64, 128, 0, 2, 128, 132)
    # no graphs: decode from batch 1 (a 128-token context never splits: one split count, its classes, 1..4, 8)
    assert [len(s.extend) for s in no_graphs if s.decode] == [1, 2, 3, 4, 5, 8]
    assert max(sum(s.extend) for s in no_graphs) <= 64


def test_launchers_are_built_on_the_pool_and_a_failure_is_only_counted():
    """build_launchers: every compiled kernel's launcher built on the pool's threads, at once (not one after
    another on the engine's thread); one that fails is counted and left to its first launch."""
    import threading
    import time

    built, threads, inside, most = [], set(), [0], [0]
    lock = threading.Lock()

    def build(kernel):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)  # gcc runs as a child process: the threads overlap
        with lock:
            inside[0] -= 1
        if kernel == "broken":
            raise RuntimeError("no C compiler")
        built.append(kernel)
        threads.add(threading.current_thread().name)

    kernels = [f"k{i}" for i in range(8)] + ["broken"]
    assert warmup.build_launchers(kernels, build, workers=4) == 1
    assert sorted(built) == sorted(kernels[:-1]) and most[0] > 1
    assert threads and all(name.startswith("minisgl-launcher") for name in threads)
    assert warmup.build_launchers([], build, workers=4) == 0


def test_discovery_leaves_a_placeholder_per_recorded_variant_and_takes_them_all_back():
    """The discovery hook records a variant once and leaves a placeholder that launches nothing in its JIT cache
    (so the variant's later launches are cache hits, not a hook call each); when discovery ends the placeholders
    are gone and the caches hold what they held before. Outside a warm-up the hook hands calls to the one that was
    there before."""
    import collections
    from types import SimpleNamespace

    import pytest
    pytest.importorskip("triton", reason="Triton is not installed (the GPU extra): there is no hook to install")
    from triton import knobs

    caches = collections.defaultdict(lambda: ({}, None, None, None, None))
    compiled = object()
    caches[0][0]["compiled-before"] = compiled
    fn = SimpleNamespace(__name__="_norm_kernel", device_caches=caches)

    def launch(key):  # what JITFunction.run does on a cache miss, as far as the hook sees it
        if key in caches[0][0]:
            return caches[0][0][key]
        return knobs.runtime.jit_cache_hook(key=key, fn=SimpleNamespace(jit_function=fn),
                                            compile={"device": 0, "specialization_data": f"spec-{key}"})

    outside = []
    knobs.runtime.jit_cache_hook, before = (lambda **kw: outside.append(kw["key"])), knobs.runtime.jit_cache_hook
    try:
        with warmup._hook_installed():
            with warmup._recording(skip=True) as found:
                assert launch("rows-1") is True  # skipped: neither compiled nor launched
                placeholder = launch("rows-1")  # the next launch finds the placeholder
                assert placeholder is warmup._SKIPPED and placeholder.run(1, 1, 1, None) is None
                assert launch("compiled-before") is compiled and launch("rows-16") is True
            assert set(found.found) == {(id(fn), "rows-1"), (id(fn), "rows-16")}
            with pytest.raises(RuntimeError, match="outside discovery"):  # never a silent no-op for real work
                placeholder.run(1, 1, 1, None)
            assert caches[0][0] == {"compiled-before": compiled}
            launch("elsewhere")
        assert outside == ["elsewhere"]
    finally:
        knobs.runtime.jit_cache_hook = before


# --- on a CPU -------------------------------------------------------------------------------------------------


def test_skipped_on_cpu(qwen3_path, make_llm):
    class Runner:  # anything but its device would raise
        device = torch.device("cpu")

    assert warmup.warm_up_kernels(Runner(), 4, True) is None
    llm = make_llm(qwen3_path, kernel_warmup=True)
    assert llm.config.kernel_warmup and llm.engine.runner.warmup is None


def _pools(runner) -> list[torch.Tensor]:
    out = [runner.kv_cache.buffer, runner.req_pool.table, runner.req_pool.token_ids]
    if runner.state_pool is not None:
        out += [runner.state_pool.conv, runner.state_pool.recurrent]
    return [t.clone() for t in out]


def _check_steps_leave_pools_alone(llm):
    runner = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    before, meta = _pools(runner), runner.attn.meta
    # the sequential path (no Triton here): every eager step of the plan, run on this engine's model
    report = warmup._warm_up(runner, graph_max_bs=0, prefill_graphs=False, num_sms=132, why_not="test")
    assert report["eager_steps"] >= 8 and report["parallel_compile"] == "test"
    assert all(torch.equal(a, b) for a, b in zip(before, _pools(runner)))
    assert runner.attn.meta is meta
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_steps_run_the_model_and_restore_the_pools(qwen3_path, make_llm):
    llm = make_llm(qwen3_path, max_running_requests=6, chunked_prefill_size=48, max_model_len=128)
    runner = llm.engine.runner
    # inside the block the steps do write page 0 (their K/V): the restore is what puts it back
    saved = runner.kv_cache.buffer[:, :, 0].clone()
    with warmup._pools_restored(runner), torch.inference_mode():
        warmup._run_step(runner, warmup.Step("mixed3", (1, 1, 1, 16)))
        assert not torch.equal(runner.kv_cache.buffer[:, :, 0], saved)
    assert torch.equal(runner.kv_cache.buffer[:, :, 0], saved)
    _check_steps_leave_pools_alone(llm)


def test_hybrid_steps_restore_the_state_pool(models_dir, make_llm):
    from test_qwen35 import make_state_sensitive, tiny_text_config
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny_text_config()).eval()
    make_state_sensitive(model, seed=1)
    path = str(models_dir / "qwen3.5-warmup")
    model.save_pretrained(path)
    llm = make_llm(path, max_running_requests=6, chunked_prefill_size=48, max_model_len=128)
    pool = llm.engine.runner.state_pool
    saved = pool.recurrent[:, pool.dummy_slot].clone()
    with warmup._pools_restored(llm.engine.runner), torch.inference_mode():
        warmup._run_step(llm.engine.runner, warmup.Step("prefill_r2", (16, 16)))
        assert not torch.equal(pool.recurrent[:, pool.dummy_slot], saved)  # the state went to the dummy slot
    _check_steps_leave_pools_alone(llm)


def test_penalty_rows_are_aligned(qwen3_path, make_llm, monkeypatch):
    """ModelRunner.processing lays the penalty values out as rows on 16-byte boundaries, so the penalty kernel
    is one Triton variant whatever the count of penalised requests (3 here: unpadded rows were 12 bytes apart)."""
    import minisgl.engine.model_runner as mr

    seen = []
    real = mr.process_logits

    def spy(logits, proc, table):
        if proc.frequency is not None:
            seen.append([t.data_ptr() for t in (proc.frequency, proc.presence, proc.repetition)])
        return real(logits, proc, table)

    monkeypatch.setattr(mr, "process_logits", spy)
    llm = make_llm(qwen3_path)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, frequency_penalty=0.5,
                            presence_penalty=0.25, repetition_penalty=1.1)
    llm.generate([[5, 6, 7], [8, 9, 10, 11], [12, 13]], params)
    assert seen and all((p - ptrs[0]) % 16 == 0 for ptrs in seen for p in ptrs)

