# generated from notebooks/01_model.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/01_model.ipynb, cell 6 (id c01-006) ---
"""Build a model from a folder (or hub id) in Hugging Face layout and load its weights.

`load_format="dummy"` needs only config.json: it fills the weights with seeded random values of a sane
scale, the way SGLang's and vLLM's `--load-format dummy` do, so performance can be measured at real shapes
without the real weights.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from minisgl.checkpoint import checkpoint_files
from minisgl.models import ARCHITECTURES, DecoderLM, ModelConfig
from minisgl.models.family import ModelFamily
from minisgl.models.registry import FAMILIES, model_family

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# HF name → (our parameter, which slice of a fused parameter). Fused: qkv_proj = [q; k; v], gate_up = [gate; up].
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


# --- notebooks/01_model.ipynb, cell 30 (id c01-029) ---
@dataclass
class LoadedModel:
    model: DecoderLM
    config: ModelConfig
    hf_config: object
    path: str


# --- notebooks/01_model.ipynb, cell 31 (id c01-030) ---
def resolve_model_path(model: str) -> str:
    """A local folder as is; anything else is taken as a hub id and downloaded (needs the network)."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"{model!r} is a file; pass the folder that holds config.json")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                        "*.txt"])
    except Exception as e:  # no network, unknown id, ...
        raise ValueError(f"model {model!r} is not a local folder and could not be fetched from the hub: {e}") from e


# --- notebooks/01_model.ipynb, cell 32 (id c01-030a) ---
def read_json_file(file: str) -> dict:
    """A JSON object from a file of a model folder, or a ValueError that says what is wrong with the file (empty,
    not UTF-8, cut short), where `json.load` would only say "Expecting value: line 1 column 1"."""
    with open(file, "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise ValueError(f"{file} is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); is the file cut short?") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, not a {type(data).__name__}")
    return data


# --- notebooks/01_model.ipynb, cell 33 (id c01-030b) ---
REQUIRED_CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def read_hf_config(path: str):
    """The folder's config.json through transformers, checked first so that a broken or foreign file gets a
    message saying what is wrong: a file that does not parse, an architecture minisgl does not run, a missing
    size (which transformers would quietly fill with its class default: 32 layers where the checkpoint has 8)."""
    from transformers import AutoConfig

    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json in {path}: not a model folder in Hugging Face layout")
    data = read_json_file(file)
    archs = data.get("architectures") if isinstance(data.get("architectures"), list) else []
    model_type = str(data.get("model_type", ""))
    if not (any(a in ARCHITECTURES for a in archs) or model_type in ARCHITECTURES.values()
            or model_type in FAMILIES):
        raise ValueError(f"{file}: unsupported architecture {archs or model_type!r}; minisgl runs "
                         f"{sorted(ARCHITECTURES)} and the model types of models/registry.py "
                         f"({', '.join(sorted(FAMILIES))})")
    sizes = data["text_config"] if isinstance(data.get("text_config"), dict) else data  # Qwen3.5 nests them
    missing = [k for k in REQUIRED_CONFIG_FIELDS if k not in sizes]
    if missing:
        raise ValueError(f"{file} lacks {', '.join(missing)}")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # a value transformers refuses (its messages are clear; its exception types vary)
        raise ValueError(f"transformers cannot read {file}: {e}") from e


# --- notebooks/01_model.ipynb, cell 34 (id c01-031) ---
def read_eos_ids(path: str, hf_config) -> tuple[int, ...]:
    """Every EOS id: generation_config.json's (often a list) wins over config.json's."""
    for source in (os.path.join(path, "generation_config.json"), None):
        eos = None
        if source and os.path.exists(source):
            eos = read_json_file(source).get("eos_token_id")
        elif source is None:
            eos = getattr(hf_config, "eos_token_id", None)
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ()


# --- notebooks/01_model.ipynb, cell 35 (id c01-032) ---
def _fused_slice(param: torch.Tensor, cfg: ModelConfig, fused: str, part: int) -> torch.Tensor:
    if fused == "qkv_proj":
        q, kv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        start, size = [(0, q), (q, kv), (q + kv, kv)][part]
    else:
        half = param.shape[0] // 2
        start, size = part * half, half
    return param.narrow(0, start, size)


# --- notebooks/01_model.ipynb, cell 38 (id c01-034b) ---
def check_checkpoint(path: str) -> None:
    """Before the model is built: the folder has .safetensors weights and every file's header reads; else an
    error naming the file (an empty or cut-short download, a file that is not safetensors at all)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index) and not isinstance(read_json_file(index).get("weight_map"), dict):
        raise ValueError(f"{index} has no weight_map")
    try:
        files = checkpoint_files(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no .safetensors weights in {path} (load_format 'dummy', --load-format dummy, "
                                "fills the model with seeded random weights instead)") from None
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} is missing (named in {index})")
        try:
            with safe_open(file, framework="pt", device="cpu"):
                pass  # opening reads and checks the header: tensor names, shapes, offsets against the file size
        except Exception as e:  # safetensors' own error type: header too small, too large, file not covered
            raise ValueError(f"{file} is not a readable safetensors file ({e}); is the download complete?") from None


# --- notebooks/01_model.ipynb, cell 39 (id c01-034) ---
def load_safetensors(model: DecoderLM, cfg: ModelConfig, path: str) -> None:
    files = checkpoint_files(path)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                name = hf_name.removeprefix("model.")
                if "rotary_emb" in name:
                    continue
                m = re.match(r"(.*)\.(\w+)\.(weight|bias)$", name)
                if m and m.group(2) in _FUSED:
                    fused, part = _FUSED[m.group(2)]
                    target_name = f"{m.group(1)}.{fused}.{m.group(3)}"
                    if target_name not in params:
                        raise KeyError(f"checkpoint tensor {hf_name} has no place in the model")
                    target = _fused_slice(params[target_name].data, cfg, fused, part)
                    loaded.add(f"{target_name}#{part}")
                else:
                    if name not in params:
                        raise KeyError(f"checkpoint tensor {hf_name} has no place in the model")
                    target = params[name].data
                    loaded.add(name)
                tensor = f.get_tensor(hf_name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
                target.copy_(tensor)
    missing = []
    for name, _ in model.named_parameters():
        fused = name.rsplit(".", 2)[-2]
        if fused in ("qkv_proj", "gate_up_proj"):
            parts = 3 if fused == "qkv_proj" else 2
            missing += [f"{name}#{i}" for i in range(parts) if f"{name}#{i}" not in loaded]
        elif name not in loaded and not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint in {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")


# --- notebooks/01_model.ipynb, cell 40 (id c01-035) ---
@torch.no_grad()
def init_dummy(model: DecoderLM, seed: int) -> None:
    """Seeded random weights at a scale that keeps activations finite in bf16."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.ndim == 1:  # biases
            p.zero_()
        else:
            std = 0.02 if "embed" in name else 1.0 / max(p.shape[1], 1) ** 0.5
            p.normal_(0.0, std, generator=gen)


# --- notebooks/01_model.ipynb, cell 41 (id c01-036) ---
def load_model(model: str, dtype: torch.dtype, device: torch.device, load_format: str = "auto",
               seed: int = 0, max_positions: int | None = None) -> LoadedModel:
    path = resolve_model_path(model)
    hf_config = read_hf_config(path)
    if load_format != "dummy":
        check_checkpoint(path)  # a broken file fails here, before the model's memory is allocated
    # the model's config class, module, dummy init and checkpoint reader: this file's, unless the registry names
    # another family for its model type (minisgl/models/registry.py: Qwen3.5's hybrid, notebook 10)
    family = model_family(hf_config) or ModelFamily("decoder", ModelConfig, DecoderLM, init_dummy, load_safetensors)
    cfg = family.config_cls.from_hf(hf_config, read_eos_ids(path, hf_config))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            net = family.model_cls(cfg, max_positions)
    finally:
        torch.set_default_dtype(old)
    if load_format == "dummy":
        family.init_dummy(net, seed)
    else:
        family.load_weights(net, cfg, path)
    net.rotary.cos_sin = net.rotary.cos_sin.float()  # the rotary table stays fp32 whatever the dtype
    net.eval().requires_grad_(False)
    return LoadedModel(net, cfg, hf_config, path)


# --- notebooks/01_model.ipynb, cell 42 (id c01-037) ---
def to_hf_state_dict(model: DecoderLM, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face names (fused tensors split), e.g. to load a transformers peer."""
    out = {}
    for name, p in model.named_parameters():
        module, leaf = name.rsplit(".", 1)
        parent, fused = (module.rsplit(".", 1) + [""])[:2] if "." in module else ("", module)
        prefix = "" if name.startswith("lm_head") else "model."
        if fused == "qkv_proj" or fused == "gate_up_proj":
            parts = ["q_proj", "k_proj", "v_proj"] if fused == "qkv_proj" else ["gate_proj", "up_proj"]
            for i, part in enumerate(parts):
                out[f"{prefix}{parent}.{part}.{leaf}"] = _fused_slice(p.data, cfg, fused, i)
        else:
            out[prefix + name] = p.data
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
