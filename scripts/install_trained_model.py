#!/usr/bin/env python
"""Install a model that ``scripts/train_tiny_model_gpu.py`` wrote (e.g. fetched back from the GPU machine).

The GPU machine returns files of at most 16 MB, so the weights come back as safetensors shards plus
``model.safetensors.index.json``. This joins them into one ``model.safetensors`` (bf16), copies the
config, generation config and ``TRAINING.json``, takes the tokenizer files from ``--tokenizer-from``
(the shipped tokenizer; it is never retrained), removes stale weight files from the destination, and
checks the result: every tensor present, and Hugging Face loads it and generates greedily.

    python scripts/install_trained_model.py SRC_DIR                       # into assets/tiny-qwen3
    python scripts/install_trained_model.py SRC_DIR --dest /tmp/candidate  # somewhere else first
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
COPIED = ("config.json", "generation_config.json", "TRAINING.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def shard_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in src.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no safetensors in {src}")
    missing = [n for n in names if not (src / n).exists()]
    if missing:
        raise FileNotFoundError(f"{src} lacks shards {missing}")
    return [src / n for n in names]


def merged_state(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in shard_files(src):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name} is in two shards")
                tensors[name] = sf.get_tensor(name)
    index = src / "model.safetensors.index.json"
    if index.exists():
        expected = set(json.loads(index.read_text())["weight_map"])
        if expected != set(tensors):
            raise ValueError(f"index and shards disagree: {sorted(expected ^ set(tensors))[:5]}")
    return tensors


def check(dest: Path, prompt: str = "The function returns") -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt")
    t = time.time()
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0])
    print(f"[check] {sum(p.numel() for p in model.parameters()):,} parameters; greedy 40 tokens in "
          f"{time.time() - t:.2f}s: {text!r}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--dest", type=Path, default=REPO / "assets" / "tiny-qwen3")
    ap.add_argument("--tokenizer-from", type=Path, default=REPO / "assets" / "tiny-qwen3")
    args = ap.parse_args()
    src, dest = args.src, args.dest
    tensors = merged_state(src)
    for name in COPIED:
        if not (src / name).exists():
            raise FileNotFoundError(f"{src} lacks {name}")
    with tempfile.TemporaryDirectory() as tmp:  # stage, so a failure leaves dest as it was
        stage = Path(tmp)
        save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
        for name in COPIED:
            shutil.copy(src / name, stage / name)
        for name in TOKENIZER_FILES:
            shutil.copy(args.tokenizer_from / name, stage / name)
        dest.mkdir(parents=True, exist_ok=True)
        for stale in [*dest.glob("*.safetensors"), dest / "model.safetensors.index.json"]:
            stale.unlink(missing_ok=True)
        for f in stage.iterdir():
            shutil.copy(f, dest / f.name)
    size = sum(p.stat().st_size for p in dest.iterdir() if p.is_file())
    print(f"[install] {len(tensors)} tensors into {dest} ({size / 1e6:.1f} MB)")
    check(dest)


if __name__ == "__main__":
    main()
