"""The loader: dummy weights from a config alone, exact safetensors loading, and clear errors."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import PROMPTS, assert_all_pages_back, hf_model
from safetensors.torch import load_file, save_file

from minisgl import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def config_only(src: str, dst) -> str:
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    return str(dst)


def capture_logits(llm) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    llm.engine.runner.model.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    return seen


# --- dummy weights -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch_fixture", ["qwen3_path", "qwen2_path"])
def test_dummy_weights_from_a_config_alone(dtype, arch_fixture, request, tmp_path, make_llm):
    path = config_only(request.getfixturevalue(arch_fixture), tmp_path / "cfg")
    assert os.listdir(path) == ["config.json"]
    llm = make_llm(path, load_format="dummy", dtype=dtype, page_size=4, seed=3)
    model = llm.engine.runner.model
    want = getattr(torch, dtype)
    assert all(p.dtype == want for p in model.parameters())
    assert llm.engine.runner.kv_cache.buffer.dtype == want
    logits = capture_logits(llm)
    outs = llm.generate(PROMPTS[:8], PARAMS)
    assert logits and all(torch.isfinite(x).all() for x in logits)
    assert all(x.dtype == want for x in logits)  # the model's dtype: the sampler widens them
    assert max(x.abs().max().item() for x in logits) > 0  # not all zero
    assert all(len(o.token_ids) == 16 and all(0 <= t < 512 for t in o.token_ids) for o in outs)
    # not degenerate: different prompts give different continuations
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert_all_pages_back(llm)


def test_dummy_weights_are_deterministic_for_a_seed(qwen3_path, tmp_path, make_llm):
    path = config_only(qwen3_path, tmp_path / "cfg")
    a = make_llm(path, load_format="dummy", seed=5)
    b = make_llm(path, load_format="dummy", seed=5)
    c = make_llm(path, load_format="dummy", seed=6)
    sa, sb, sc = (x.engine.runner.model.state_dict() for x in (a, b, c))
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if "norm" not in k)
    oa, ob, oc = (x.generate(PROMPTS[:6], PARAMS) for x in (a, b, c))
    assert [o.token_ids for o in oa] == [o.token_ids for o in ob]
    assert [o.token_ids for o in oa] != [o.token_ids for o in oc]


def test_auto_format_without_weights_is_a_clear_error(qwen3_path, tmp_path, make_llm):
    path = config_only(qwen3_path, tmp_path / "cfg")
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        make_llm(path)


# --- real weights ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch_fixture", ["qwen3_path", "llama_path", "qwen2_path"])
def test_loaded_weights_equal_the_checkpoint(arch_fixture, request, make_llm):
    path = request.getfixturevalue(arch_fixture)
    llm = make_llm(path, dtype="float32")
    ours = dict(llm.engine.runner.model.named_parameters(remove_duplicate=False))
    hf = dict(hf_model(path).named_parameters(remove_duplicate=False))
    checked = 0
    for name, p in ours.items():
        hf_name = name if name.startswith("lm_head") else "model." + name
        if ".qkv_proj." in name:
            parts = [hf[hf_name.replace("qkv_proj", x)] for x in ("q_proj", "k_proj", "v_proj")]
        elif ".gate_up_proj." in name:
            parts = [hf[hf_name.replace("gate_up_proj", x)] for x in ("gate_proj", "up_proj")]
        else:
            parts = [hf[hf_name]]
        assert torch.equal(p, torch.cat(parts)), name
        checked += 1
    assert checked == len(ours) and checked > 10


def test_bf16_checkpoint_runs(qwen3_path, make_llm):
    llm = make_llm(qwen3_path, dtype="bfloat16", page_size=4)
    logits = capture_logits(llm)
    outs = llm.generate(PROMPTS[:8], PARAMS)
    assert all(torch.isfinite(x).all() for x in logits)
    assert all(len(o.token_ids) == 16 for o in outs)


# --- broken checkpoints ------------------------------------------------------------------------------------

def edited_checkpoint(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("arch_fixture,drop,expect", [
    ("qwen3_path", "model.layers.1.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight"),
    ("qwen3_path", "model.layers.0.self_attn.k_proj.weight", r"layers.0.self_attn.qkv_proj.weight#1"),
    ("qwen3_path", "model.layers.0.mlp.up_proj.weight", r"layers.0.mlp.gate_up_proj.weight#1"),
    ("qwen3_path", "model.layers.1.self_attn.q_norm.weight", "layers.1.self_attn.q_norm.weight"),
    ("qwen3_path", "model.norm.weight", "norm.weight"),
    ("qwen2_path", "model.layers.0.self_attn.v_proj.bias", r"layers.0.self_attn.qkv_proj.bias#2"),
    ("llama_path", "lm_head.weight", "lm_head.weight"),  # untied: the head is needed
], ids=["down_proj", "k_proj", "up_proj", "q_norm", "final-norm", "v-bias", "untied-lm_head"])
def test_missing_tensor_is_a_clear_error(arch_fixture, drop, expect, request, tmp_path):
    from minisgl import LLM

    src = request.getfixturevalue(arch_fixture)
    path = edited_checkpoint(src, tmp_path / "broken", lambda t: t.pop(drop))
    with pytest.raises(ValueError, match=r"lacks 1 tensors") as info:
        LLM(path)
    assert expect in str(info.value), str(info.value)


def test_tied_checkpoint_needs_no_lm_head(qwen3_path):
    from safetensors import safe_open
    with safe_open(os.path.join(qwen3_path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # and it loads (the parity tests run it)


def test_unexpected_and_misshapen_tensors(qwen3_path, tmp_path):
    from minisgl import LLM

    def extra(t):
        t["model.layers.0.self_attn.mystery.weight"] = torch.zeros(3)

    with pytest.raises(KeyError, match="mystery.weight has no place"):
        LLM(edited_checkpoint(qwen3_path, tmp_path / "extra", extra))

    def misshapen(t):
        t["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 100)

    with pytest.raises(ValueError, match=r"down_proj.weight: checkpoint shape \(64, 100\)"):
        LLM(edited_checkpoint(qwen3_path, tmp_path / "shape", misshapen))


def test_unsupported_architecture(qwen3_path, tmp_path):
    import json

    from minisgl import LLM

    path = config_only(qwen3_path, tmp_path / "cfg")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(path, load_format="dummy")


def test_model_families_are_picked_by_the_registry():
    """The loader and the engine ask one registry what a model type needs: Qwen3.5's own classes and the
    linear-state runtime; any other type the decoder of notebook 01 over a KV cache only."""
    from types import SimpleNamespace

    import pytest

    from minisgl.engine.hybrid import LinearStateRuntime
    from minisgl.engine.runtime import ModelRuntime
    from minisgl.engine.runtimes import make_runtime
    from minisgl.models.qwen3_5 import Qwen35LM
    from minisgl.models.registry import model_family, runtime_name

    for model_type in ("qwen3_5", "qwen3_5_text"):
        hf = SimpleNamespace(model_type=model_type)
        assert model_family(hf).model_cls is Qwen35LM and runtime_name(hf) == "linear_state"
    for model_type in ("qwen3", "llama", "qwen2", ""):
        hf = SimpleNamespace(model_type=model_type)
        assert model_family(hf) is None and runtime_name(hf) == "kv"
    assert type(make_runtime("kv", None)) is ModelRuntime
    with pytest.raises(ValueError, match="unknown model runtime"):
        make_runtime("mamba", None)
    assert issubclass(LinearStateRuntime, ModelRuntime)
