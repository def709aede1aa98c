#!/usr/bin/env python
"""Install a model that ``lab/tinymodel/train_gpu.py`` wrote (e.g. fetched back from the GPU machine).

The GPU machine returns files of at most 16 MB, so the weights come back as safetensors shards plus
``model.safetensors.index.json``. This joins them into one ``model.safetensors`` (bf16), copies the
config, generation config and ``TRAINING.json``, takes the tokenizer files from ``--tokenizer-from``
(the shipped tokenizer; it is never retrained), removes stale weight files from the destination, and
checks the result: every tensor present, and Hugging Face loads it and generates greedily.

    python -m lab.tinymodel.install SRC_DIR                       # into assets/tiny-qwen3
    python -m lab.tinymodel.install SRC_DIR --dest /tmp/candidate  # somewhere else first
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

from lab import REPO

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


def check(dest: Path, tokens: int = 40) -> dict:
    """Load the installed model with Hugging Face, on the CPU in fp32 as the tests and the demo do, and record
    into its TRAINING.json (`installed_check`) what a user meets: greedy text for the trainer's sample prompts
    with its repeated-4-gram share, and how sharp the predictions along those continuations are (near-ties
    between the top two logits are where two correct engines may pick different greedy tokens)."""
    from train_tiny_model_gpu import SAMPLE_PROMPTS, repeated_ngram_share
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    samples, top_probs, gaps, seconds = {}, [], [], []
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt")
        t = time.time()
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=tokens, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        seconds.append(time.time() - t)
        new = out.sequences[0, ids["input_ids"].shape[1]:].tolist()
        samples[prompt] = {"text": tok.decode(out.sequences[0]), "repeated_4gram_share": round(
            repeated_ngram_share(new), 3)}
        for scores in out.scores:
            top2 = scores[0].float().topk(2)
            top_probs.append(scores[0].float().softmax(-1).max().item())
            gaps.append((top2.values[0] - top2.values[1]).item())
    gaps.sort()
    result = {"parameters": sum(p.numel() for p in model.parameters()), "greedy_tokens": tokens,
              "greedy_seconds_each": [round(x, 2) for x in seconds], "samples": samples,
              "mean_top_token_probability": round(sum(top_probs) / len(top_probs), 3),
              "median_top2_logit_gap": round(gaps[len(gaps) // 2], 3), "smallest_top2_logit_gap": round(gaps[0], 5),
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    record = dest / "TRAINING.json"
    data = json.loads(record.read_text())
    data["installed_check"] = result
    record.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    for sample in samples.values():
        print(f"[check] {sample['repeated_4gram_share']:.3f} repeated: {sample['text']!r}")
    print(f"[check] {result['parameters']:,} parameters; mean top-token probability "
          f"{result['mean_top_token_probability']}, median top-2 logit gap {result['median_top2_logit_gap']}")
    return result


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
            (stage / name).chmod(0o644)  # the device returns read-only files
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
