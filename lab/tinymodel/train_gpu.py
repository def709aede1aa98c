#!/usr/bin/env python
"""Train the embedded model on one GPU in a fixed wall-clock budget, from a pre-tokenized corpus.

The GPU mode of ``lab/tinymodel/train.py``: same tokenizer (copied from ``assets/tiny-qwen3``),
same chat template and special tokens, a larger Qwen3 model and far more tokens. The corpus comes from
``lab/tinymodel/corpus.py`` (``.train-data/pack``: uint16 token streams, xz-compressed).

    # on the GPU machine (torch and transformers already there):
    python -m lab.tinymodel.train_gpu --data .train-data/pack --out /tmp/model --time-budget 200
    # end-to-end check of the same code path on a CPU, in seconds:
    python -m lab.tinymodel.train_gpu --device cpu --time-budget 20 --batch-size 4 --seq-len 128 \
        --eval-tokens 4096 --out /tmp/tiny-gpu-check

The device call (carry [".train-data/pack"]; eight files come back: the log, config, generation config,
three weight shards, the shard index and TRAINING.json), then here ``lab/tinymodel/install.py``:

    set -o pipefail; python3 -m lab.tinymodel.train_gpu --data .train-data/pack --out /tmp/m \
      --time-budget 200 2>&1 | tee $OUT/train.log; rc=$?; cd /tmp/m && cp config.json \
      generation_config.json model-*.safetensors model.safetensors.index.json TRAINING.json $OUT/; exit $rc

Training: bf16 autocast over fp32 master weights, AdamW (fused on CUDA), warmup then cosine decay,
where the schedule runs on *elapsed time* over the budget, so the LR reaches its floor as the budget
ends whatever the speed of the machine. When the budget is spent the script evaluates the held-out
loss, writes the model in bf16 as safetensors shards under ``--shard-size`` (the device returns files of
at most 16 MB), the tokenizer files, and ``TRAINING.json`` (corpus, sizes, steps, tokens, loss curve,
held-out loss, wall time, device, greedy samples).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from lab.tinymodel import corpus as build_corpus
from lab.tinymodel import train as ttm

REPO = ttm.REPO
TOKENIZER_DIR = REPO / "assets" / "tiny-qwen3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SAMPLE_PROMPTS = ["The function returns", "This module provides", "If the file does not exist,"]
SAMPLE_TOKENS = 60


def make_config(args) -> Qwen3Config:
    eot, im_end = 0, 2  # <|endoftext|>, <|im_end|> in the shipped tokenizer
    return ttm.qwen3_config(eot, im_end, args.hidden, args.mlp, args.layers, args.heads, args.kv_heads, "bfloat16")


def lr_at(progress: float, step: int, args) -> float:
    """Linear warmup over the first steps, then cosine from peak to a floor over the time budget."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    p = min(1.0, progress)
    return args.lr * (ttm.MIN_LR_FRACTION + (1 - ttm.MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * p)))


def random_batch(data: torch.Tensor, n: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """n random windows of seq_len + 1 tokens, gathered on the data's device."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (n, 1), generator=gen, device=data.device)
    return data[starts + torch.arange(seq_len + 1, device=data.device)].long()


def lm_loss(model, x: torch.Tensor, device_type: str, unlikelihood: float = 0.0) -> torch.Tensor:
    """Next-token cross-entropy, plus (weight `unlikelihood` > 0) token-level unlikelihood training
    (Welleck et al. 2019, "Neural text generation with unlikelihood training"): every token already seen in
    the window before position t, other than the true next one, is a negative at t, and the loss adds
    -log(1 - p(negative)). It teaches a small model not to copy its own context, the root of greedy loops."""
    inputs, targets = x[:, :-1], x[:, 1:]
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        logits = model(input_ids=inputs).logits
    logits = logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    if unlikelihood > 0:
        b, t = inputs.shape
        pos = torch.arange(t, device=x.device)
        # first[b, v]: where token v first occurs in the window (t when it does not): seen at t iff first <= t
        first = torch.full((b, logits.size(-1)), t, device=x.device, dtype=torch.long)
        first.scatter_reduce_(1, inputs, pos.expand(b, t), reduce="amin")
        seen = first[:, None, :] <= pos[None, :, None]
        seen.scatter_(2, targets[..., None], False)  # the true next token is never a negative
        probs = logits.softmax(-1)
        ul = -(torch.log1p(-probs.clamp(max=1 - 1e-5)) * seen).sum(-1).mean()
        loss = loss + unlikelihood * ul
    return loss


def repeat_mask(ids: torch.Tensor, n: int = 4) -> torch.Tensor:
    """[B, L] bool: the positions covered by an n-gram that already occurred earlier in the same row (the
    tokens a greedy loop repeats). Rows are short (~100 tokens), so a Python pass per row is cheap."""
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for r, row in enumerate(ids.tolist()):
        seen: set[tuple[int, ...]] = set()
        for i in range(len(row) - n + 1):
            gram = tuple(row[i:i + n])
            if gram in seen:
                mask[r, i:i + n] = True
            seen.add(gram)
    return mask


@torch.no_grad()
def greedy_continue(model, prefixes: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[B, new_tokens]: the model's own greedy continuation of each prefix (end-of-text suppressed, so every
    row is full length)."""
    model.eval()
    with torch.autocast(device_type=prefixes.device.type, dtype=torch.bfloat16):
        out = model.generate(input_ids=prefixes, attention_mask=torch.ones_like(prefixes), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    model.train()
    return out[:, prefixes.shape[1]:]


def sequence_unlikelihood_loss(model, prefixes: torch.Tensor, continuations: torch.Tensor,
                               device_type: str, n: int = 4) -> tuple[torch.Tensor, float]:
    """Sequence-level unlikelihood (Welleck et al. 2019, section 5.2): the model continues real prefixes
    greedily; every continuation token that belongs to a repeated n-gram is a negative, and the loss is
    -log(1 - p(token | its context)) over those tokens. Token-level training alone left the models looping
    (reports/h200/tinymodel/); this penalises the loops the model actually produces. Returns the loss and the
    share of continuation tokens that were in a repeat."""
    x = torch.cat([prefixes, continuations], dim=1)
    mask = repeat_mask(continuations, n)
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        logits = model(input_ids=x[:, :-1]).logits
    p = prefixes.shape[1]
    logits = logits[:, p - 1:].float()  # the positions that predicted each continuation token
    prob = logits.softmax(-1).gather(-1, continuations[..., None]).squeeze(-1)
    ul = -torch.log1p(-prob.clamp(max=1 - 1e-5))
    # summed over the negatives, averaged over all continuation tokens: the push fades as the loops do
    return (ul * mask).sum() / mask.numel(), mask.float().mean().item()


def repeated_ngram_share(ids: list[int], n: int = 4) -> float:
    """seq-rep-n: the share of n-grams of a continuation that already occurred earlier in it (0: no loop)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


@torch.no_grad()
def heldout_loss(model, held: torch.Tensor, args, device_type: str) -> float:
    """Mean loss over consecutive non-overlapping windows of the first --eval-tokens held-out tokens."""
    model.eval()
    n_windows = max(1, min(held.numel() - 1, args.eval_tokens) // args.seq_len)
    windows = held[: n_windows * args.seq_len + 1]
    idx = torch.arange(n_windows, device=held.device)[:, None] * args.seq_len + \
        torch.arange(args.seq_len + 1, device=held.device)
    total = 0.0
    for chunk in idx.split(args.batch_size):
        total += lm_loss(model, windows[chunk].long(), device_type).item() * chunk.size(0)
    model.train()
    return total / n_windows


def heldout_repetition(model, held: torch.Tensor, prefixes: int = 64, prefix_tokens: int = 32,
                       new_tokens: int = 64) -> float:
    """Mean seq-rep-4 of the model's greedy continuations of held-out prefixes (evenly spaced, so the same ones
    before and after fine-tuning): how much the model loops on text it never trained on."""
    step = (held.numel() - prefix_tokens) // prefixes
    starts = torch.arange(prefixes, device=held.device)[:, None] * step
    ids = held[starts + torch.arange(prefix_tokens, device=held.device)].long()
    conts = greedy_continue(model, ids, new_tokens)
    return round(sum(repeated_ngram_share(row) for row in conts.tolist()) / prefixes, 4)


@torch.no_grad()
def greedy_samples(model, tok, device) -> dict[str, str]:
    model.eval()
    out = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt").to(device)
        gen = model.generate(**ids, max_new_tokens=SAMPLE_TOKENS, do_sample=False)
        new = gen[0, ids["input_ids"].shape[1]:].tolist()
        out[prompt] = {"text": tok.decode(gen[0], skip_special_tokens=False),
                       "repeated_4gram_share": round(repeated_ngram_share(new), 3)}
    return out


def seq_ul_phase(model, train: torch.Tensor, held: torch.Tensor, gen: torch.Generator, args,
                 device_type: str) -> dict:
    """Fine-tune at a constant small LR for --seq-ul-seconds, alternating a sequence-level unlikelihood update
    on the model's own greedy continuations with a plain cross-entropy update (which keeps the model a
    language model: Welleck et al. mix the two the same way). Returns the phase's record."""
    tok = PreTrainedTokenizerFast.from_pretrained(TOKENIZER_DIR)
    before = {"heldout": round(heldout_loss(model, held, args, device_type), 4),
              "heldout_repetition": heldout_repetition(model, held),
              "samples": greedy_samples(model, tok, train.device)}
    print(f"[seq-ul] before: held-out {before['heldout']:.4f}, greedy seq-rep-4 {before['heldout_repetition']}",
          flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.seq_ul_lr, betas=(0.9, 0.95), weight_decay=0.0)
    history, updates, t0 = [], 0, time.time()
    while time.time() - t0 < args.seq_ul_seconds:
        if updates % 2 == 0:
            prefixes = random_batch(train, args.seq_ul_batch, args.seq_ul_prefix - 1, gen)
            conts = greedy_continue(model, prefixes, args.seq_ul_len)
            loss, repeat_share = sequence_unlikelihood_loss(model, prefixes, conts, device_type)
        else:
            loss = lm_loss(model, random_batch(train, args.batch_size, args.seq_len, gen), device_type)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if updates % 2 == 0:
            history.append({"update": updates, "seconds": round(time.time() - t0, 1),
                            "ul_loss": round(loss.item(), 4), "repeated_token_share": round(repeat_share, 4)})
            if len(history) % 10 == 1:
                print(f"[seq-ul] update {updates:5d}  ul {loss.item():.4f}  repeated tokens "
                      f"{repeat_share:.3f}  {time.time() - t0:6.1f}s", flush=True)
        else:
            history[-1]["lm_loss"] = round(loss.item(), 4)
        updates += 1
    after = round(heldout_loss(model, held, args, device_type), 4)
    rep_after = heldout_repetition(model, held)
    print(f"[seq-ul] {updates} updates in {time.time() - t0:.0f}s: held-out {before['heldout']:.4f} -> {after:.4f}, "
          f"greedy seq-rep-4 {before['heldout_repetition']} -> {rep_after}", flush=True)
    return {"seconds": args.seq_ul_seconds, "updates": updates, "lr": args.seq_ul_lr,
            "batch": args.seq_ul_batch, "prefix_tokens": args.seq_ul_prefix, "generated_tokens": args.seq_ul_len,
            "ngram": 4, "before": before, "heldout_after": after, "heldout_repetition_after": rep_after,
            "history": history}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=build_corpus.PACK)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--time-budget", type=float, default=200.0, help="seconds of training (not setup/eval)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps too (0: no limit)")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--mlp", type=int, default=1152)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--eval-tokens", type=int, default=1_000_000)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--shard-size", default="14MB")
    ap.add_argument("--unlikelihood", type=float, default=0.0,
                    help="weight of the token-level unlikelihood loss (0: plain cross-entropy)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (off: compile time)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this saved model instead of random weights (e.g. to fine-tune only)")
    ap.add_argument("--seq-ul-seconds", type=float, default=0.0,
                    help="after pre-training, this many seconds of sequence-level unlikelihood fine-tuning")
    ap.add_argument("--seq-ul-lr", type=float, default=1e-4)
    ap.add_argument("--seq-ul-batch", type=int, default=64, help="prefixes per unlikelihood update")
    ap.add_argument("--seq-ul-prefix", type=int, default=32, help="tokens of real text each continuation starts from")
    ap.add_argument("--seq-ul-len", type=int, default=96, help="greedy tokens generated per prefix")
    args = ap.parse_args()

    wall0 = time.time()
    device = torch.device(args.device)
    dt = device.type
    if dt == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = "cpu"
    torch.manual_seed(ttm.SEED)
    print(f"[setup] torch {torch.__version__}, transformers {transformers.__version__}, {device_name}",
          flush=True)

    corpus = json.loads((args.data / "corpus.json").read_text())
    train_np = build_corpus.load_stream(args.data / "train.u16.xz")
    held_np = build_corpus.load_stream(args.data / "heldout.u16.xz")
    for name, arr in (("train", train_np), ("heldout", held_np)):  # the pack travelled: check it
        if hashlib.sha256(arr.tobytes()).hexdigest() != corpus["streams"][name]["sha256_uint16"]:
            raise SystemExit(f"{name} stream does not match corpus.json: rebuild the pack")
    train = torch.from_numpy(train_np.astype(np.int32)).to(device)
    held = torch.from_numpy(held_np.astype(np.int32)).to(device)
    print(f"[data] train {train.numel():,} tokens, held-out {held.numel():,} ({time.time() - wall0:.1f}s)",
          flush=True)

    if args.init_from:
        model = Qwen3ForCausalLM.from_pretrained(args.init_from, dtype=torch.float32).to(device)
        config = model.config
    else:
        config = make_config(args)
        model = Qwen3ForCausalLM(config).float().to(device)  # fp32 master weights; bf16 under autocast
    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = args.batch_size * args.seq_len
    print(f"[model] {n_params:,} parameters; {tokens_per_step:,} tokens/step", flush=True)
    step_model = torch.compile(model) if args.compile else model

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": ttm.WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=(dt == "cuda"),
    )
    gen = torch.Generator(device=device).manual_seed(ttm.SEED)
    init_held = heldout_loss(model, held, args, dt)
    print(f"[eval] held-out loss at init {init_held:.4f}", flush=True)

    history: list[dict] = []
    heldout_curve: list[dict] = []
    next_eval = 0.25
    recent = torch.zeros((), device=device)
    n_recent = 0
    step = 0
    model.train()
    if dt == "cuda":
        torch.cuda.synchronize()
    t0 = time.time()
    while True:
        elapsed = time.time() - t0
        if elapsed >= args.time_budget or (args.max_steps and step >= args.max_steps):
            break
        progress = elapsed / args.time_budget
        lr = lr_at(progress, step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = lm_loss(step_model, random_batch(train, args.batch_size, args.seq_len, gen), dt,
                       args.unlikelihood)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent += loss.detach()
        n_recent += 1
        step += 1
        if step % args.log_every == 0 or step == 1:
            avg = (recent / n_recent).item()  # one sync per log line, not per step
            recent.zero_()
            n_recent = 0
            el = time.time() - t0
            history.append({"step": step, "seconds": round(el, 1), "loss": round(avg, 4), "lr": round(lr, 6)})
            print(f"[train] step {step:6d}  loss {avg:.4f}  lr {lr:.2e}  {el:6.1f}s  "
                  f"{step * tokens_per_step / el / 1e3:8.1f}k tok/s", flush=True)
        if progress >= next_eval and next_eval < 1.0:
            h = heldout_loss(model, held, args, dt)
            heldout_curve.append({"step": step, "seconds": round(time.time() - t0, 1), "heldout": round(h, 4)})
            print(f"[eval] step {step} held-out {h:.4f}", flush=True)
            next_eval = (math.floor(progress * 4) + 1) / 4  # a slow step may pass several quarters
    if dt == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.time() - t0
    tokens_seen = step * tokens_per_step

    held_loss = heldout_loss(model, held, args, dt)
    heldout_curve.append({"step": step, "seconds": round(train_seconds, 1), "heldout": round(held_loss, 4)})
    print(f"[eval] after {step} steps ({tokens_seen:,} tokens, {train_seconds:.0f}s): held-out {held_loss:.4f} "
          f"(ppl {math.exp(held_loss):.1f})", flush=True)

    seq_ul = None
    if args.seq_ul_seconds > 0:
        seq_ul = seq_ul_phase(model, train, held, gen, args, dt)
        held_loss = seq_ul["heldout_after"]

    # Weights first, so that a failure in anything after (tokenizer, sampling) loses nothing.
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[0, 2], pad_token_id=0,
                                               do_sample=False)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=args.shard_size)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, out / name)
    ttm.make_portable(out)
    try:
        samples = greedy_samples(model, PreTrainedTokenizerFast.from_pretrained(out), device)
    except Exception as exc:  # noqa: BLE001 - the record says what failed; the weights are saved
        samples = {"error": repr(exc)}
    for prompt, text in samples.items():
        print(f"[sample] {prompt!r} -> {text!r}", flush=True)

    record = {
        "seed": ttm.SEED,
        "device": device_name,
        "parameters": n_params,
        "architecture": {k: getattr(config, k) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")},
        "weights_dtype": "bfloat16",
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens_per_step": tokens_per_step,
        "steps": step,
        "tokens_seen": tokens_seen,
        "epochs": round(tokens_seen / max(1, train.numel()), 2),
        "tokens_per_second": round(tokens_seen / max(train_seconds, 1e-9)),
        "optimizer": {"name": "AdamW", "fused": dt == "cuda", "peak_lr": args.lr, "betas": [0.9, 0.95],
                      "weight_decay": ttm.WEIGHT_DECAY, "warmup_steps": args.warmup_steps,
                      "schedule": f"cosine over the {args.time_budget:.0f}s budget to "
                                  f"{ttm.MIN_LR_FRACTION} x peak", "grad_clip": 1.0},
        "autocast": "bfloat16",
        "unlikelihood_weight": args.unlikelihood,
        "sequence_unlikelihood": seq_ul,
        "compiled": args.compile,
        # fine-tuning an earlier model: its own record, so the shipped TRAINING.json tells the whole history
        "init_from": None if args.init_from is None else {
            "path": str(args.init_from),
            "record": json.loads((args.init_from / "TRAINING.json").read_text())
            if (args.init_from / "TRAINING.json").is_file() else None},
        "corpus": {**{k: v for k, v in corpus.items() if k != "command"},
                   "train_tokens": int(train.numel()), "heldout_tokens": int(held.numel())},
        "loss": {"heldout_at_init": round(init_held, 4), "heldout": round(held_loss, 4),
                 "heldout_eval_tokens": min(held.numel(), args.eval_tokens),
                 "train_last_window": history[-1]["loss"] if history else None},
        "training": {"history": history, "heldout_curve": heldout_curve,
                     "time_budget_seconds": args.time_budget, "train_seconds": round(train_seconds, 1)},
        f"samples_greedy_{SAMPLE_TOKENS}_tokens": samples,
        "wall_seconds_total": round(time.time() - wall0, 1),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "command": "python -m lab.tinymodel.train_gpu " + " ".join(sys.argv[1:]),
    }
    (out / "TRAINING.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(f"[done] wrote {out} ({ttm.dir_size(out) / 1e6:.1f} MB) in {time.time() - wall0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
