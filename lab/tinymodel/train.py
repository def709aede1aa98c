#!/usr/bin/env python
"""Train the tiny Qwen3-architecture model that ships in ``assets/tiny-qwen3/``.

Everything happens on CPU, on one thread, from text that is already on the machine:
no network and no downloaded data sets. Run from the repository root:

    python -m lab.tinymodel.train                 # full run, writes assets/tiny-qwen3/
    python -m lab.tinymodel.train --steps 5 --out /tmp/x   # quick smoke test / timing

Stages:

1. Corpus (English prose from the local Python installation; see ``build_corpus``):
   a. docstrings of every standard-library module under ``sysconfig.get_paths()["stdlib"]``
      (module, class and function docstrings), found by walking the modules with
      ``pkgutil.iter_modules`` and reading the sources with ``ast``: nothing is imported, so
      no module side effects run;
   b. documentation files in site-packages (``sysconfig.get_paths()["purelib"]``):
      ``*.txt``, ``*.rst``, ``*.md`` files and the long descriptions in ``*.dist-info/METADATA``,
      kept only when they look like prose (mostly letters and spaces);
   c. docstrings of the top-level packages in site-packages, read the same way as (a), with at
      most ``PER_PACKAGE_CAP`` bytes taken from each package so no single library dominates.
   Text is whitespace-normalised and de-duplicated at paragraph level (licence boilerplate
   and copied docstrings appear once). Files are visited in sorted order, so the corpus is
   the same on the same installation; on another machine the exact bytes differ with the
   installed packages.
2. A byte-level BPE tokenizer (``tokenizers``), vocabulary 4096, with ``<|endoftext|>``,
   ``<|im_start|>`` and ``<|im_end|>`` as special tokens and a ChatML chat template.
3. ``Qwen3ForCausalLM`` (4 layers, hidden 256) trained from scratch in fp32 with AdamW.
4. ``save_pretrained`` (safetensors) plus ``TRAINING.json`` with the run's numbers.
5. Greedy continuations of a few prompts, printed as a sanity check.
"""

from __future__ import annotations

import os

# One thread everywhere (the machine is shared): BLAS/OpenMP, and the Rust thread pool
# that `tokenizers` uses. These must be set before torch / tokenizers are imported.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS",
             "RAYON_RS_NUM_CPUS"):
    os.environ[_var] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import ast  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pkgutil  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

torch.set_num_threads(1)
torch.set_num_interop_threads(1)

REPO = Path(__file__).resolve().parents[2]  # lab/tinymodel/ -> the repository
SEED = 1234

# ---- corpus -----------------------------------------------------------------------------
SKIP_MODULE_NAMES = {"site-packages", "test", "tests", "testing", "idle_test", "__pycache__"}
DOC_SUFFIXES = (".txt", ".rst", ".md")
PER_PACKAGE_CAP = 60_000  # bytes of docstrings taken from any one site-packages package
PER_DOCDIR_CAP = 150_000  # bytes of doc files taken from any one top-level site-packages folder
CORPUS_CAP = 6_000_000  # stop adding text beyond this many bytes
MIN_PARAGRAPH = 40  # paragraphs shorter than this (in characters) are dropped
MIN_PARAGRAPH_PROSE = 0.6  # ... and so are paragraphs with a lower prose_score (tables, data)
HELDOUT_EVERY = 25  # a document whose hash is 0 mod this goes to the held-out split

# ---- tokenizer --------------------------------------------------------------------------
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ---- training ---------------------------------------------------------------------------
SEQ_LEN = 256
BATCH_SIZE = 16
PEAK_LR = 3e-3
MIN_LR_FRACTION = 0.1
WEIGHT_DECAY = 0.1
WARMUP_FRACTION = 0.05
# Chosen by timing: on the machine that made the shipped model (one thread of a 2-core AMD EPYC,
# AVX2, torch 2.13 CPU, ~43 GFLOP/s fp32 matmul) a step of 16 x 256 tokens took about 3.1 s when
# the machine was quiet, so 250 steps would train in about 13 minutes. The shipped run shared the
# CPU with other jobs: 5.4 s/step, 22.6 minutes of training, 25.7 minutes for the whole script.
# TRAINING.json records the actual times.
STEPS = 250
EVAL_BATCHES = 10
LOG_EVERY = 20

PROMPTS = ["The function returns", "This module provides", "def", "If the file does not exist,"]


# =========================================================================================
# Corpus
# =========================================================================================
RST_DIRECTIVE = re.compile(r"^\s*\.\. .*$", re.M)  # ".. note::", ".. versionadded:: 3.2", ...
RST_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?([^`]+)`")  # :func:`~os.path.join` -> os.path.join
RST_LITERAL = re.compile(r"``([^`\n]+)``")  # ``None`` -> None
RST_UNDERLINE = re.compile(r"^\s*([=\-~^*#+])\1{3,}\s*$", re.M)  # ===== heading rules


def strip_markup(text: str) -> str:
    """Drop the commonest reStructuredText markup so the text reads as plain prose."""
    text = RST_DIRECTIVE.sub("", text)
    text = RST_ROLE.sub(r"\1", text)
    text = RST_LITERAL.sub(r"\1", text)
    return RST_UNDERLINE.sub("", text)


def normalise(text: str) -> str:
    """Plain-text markup, tabs to spaces, no trailing spaces or runs of blank lines, no control chars."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").expandtabs(4)
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)
    text = strip_markup(text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def prose_score(text: str) -> float:
    """Fraction of characters that are ASCII letters or spaces: high for prose, low for data."""
    if not text:
        return 0.0
    good = sum(1 for c in text if c.isascii() and (c.isalpha() or c == " "))
    return good / len(text)


def walk_modules(paths: list[str], prefix: str = ""):
    """Yield (dotted name, source file) for every module below `paths`, without importing."""
    for info in sorted(pkgutil.iter_modules(paths), key=lambda m: m.name):
        if info.name in SKIP_MODULE_NAMES:
            continue
        base = os.path.join(info.module_finder.path, info.name)
        if info.ispkg:
            init = os.path.join(base, "__init__.py")
            if os.path.isfile(init):
                yield prefix + info.name, init
            yield from walk_modules([base], prefix + info.name + ".")
        elif os.path.isfile(base + ".py"):
            yield prefix + info.name, base + ".py"


def docstrings(path: str) -> list[str]:
    """Module, class and function docstrings of one source file (parsed, not imported)."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, OSError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                found.append(doc)
    return found


def metadata_description(path: Path) -> str:
    """The long description of a dist-info METADATA file: the body after the headers."""
    text = path.read_text(encoding="utf-8", errors="replace")
    _, sep, body = text.partition("\n\n")
    return body if sep else ""


class CorpusBuilder:
    def __init__(self):
        self.seen: set[bytes] = set()
        self.docs: list[str] = []
        self.size = 0
        self.by_source: dict[str, int] = {}

    def add(self, text: str, source: str) -> int:
        """Add one document; return the number of bytes kept after paragraph de-duplication."""
        kept = []
        for para in normalise(text).split("\n\n"):
            para = para.strip("\n")
            if len(para.strip()) < MIN_PARAGRAPH or prose_score(para) < MIN_PARAGRAPH_PROSE:
                continue
            key = hashlib.sha1(" ".join(para.split()).lower().encode()).digest()
            if key in self.seen:
                continue
            self.seen.add(key)
            kept.append(para)
        if not kept:
            return 0
        doc = "\n\n".join(kept)
        n = len(doc.encode("utf-8"))
        self.docs.append(doc)
        self.size += n
        self.by_source[source] = self.by_source.get(source, 0) + n
        return n

    def full(self) -> bool:
        return self.size >= CORPUS_CAP


def build_corpus() -> tuple[list[str], dict]:
    paths = sysconfig.get_paths()
    stdlib, purelib = paths["stdlib"], paths["purelib"]
    cb = CorpusBuilder()

    # (a) standard-library docstrings: one document per module.
    for _, path in walk_modules([stdlib]):
        cb.add("\n\n".join(docstrings(path)), "stdlib docstrings")
    print(f"[corpus] stdlib docstrings: {cb.size:,} bytes", flush=True)

    # (b) documentation files in site-packages, sorted by path, prose only, capped per
    # top-level folder (without the cap, awscli's thousands of example pages would dominate).
    sp = Path(purelib)
    files = sorted(p for p in sp.rglob("*") if p.is_file() and (
        p.suffix.lower() in DOC_SUFFIXES or (p.name == "METADATA" and p.parent.name.endswith(".dist-info"))))
    per_dir: dict[str, int] = {}
    for p in files:
        if cb.full():
            break
        top = p.relative_to(sp).parts[0]
        if per_dir.get(top, 0) >= PER_DOCDIR_CAP:
            continue
        try:
            if p.stat().st_size > 2_000_000:
                continue
            text = metadata_description(p) if p.name == "METADATA" else p.read_text(
                encoding="utf-8", errors="strict")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 200 or prose_score(text) < 0.75:
            continue
        per_dir[top] = per_dir.get(top, 0) + cb.add(text, "site-packages doc files")
    print(f"[corpus] + site-packages doc files: {cb.size:,} bytes", flush=True)

    # (c) site-packages docstrings, one document per module, capped per top-level package.
    per_package: dict[str, int] = {}
    for name, path in walk_modules([purelib]):
        if cb.full():
            break
        top = name.split(".")[0]
        if per_package.get(top, 0) >= PER_PACKAGE_CAP:
            continue
        per_package[top] = per_package.get(top, 0) + cb.add(
            "\n\n".join(docstrings(path)), "site-packages docstrings")
    print(f"[corpus] + site-packages docstrings: {cb.size:,} bytes "
          f"({len(per_package)} packages)", flush=True)

    info = {
        "python": sys.version.split()[0],
        "stdlib_dir": stdlib,
        "site_packages_dir": purelib,
        "bytes": cb.size,
        "documents": len(cb.docs),
        "bytes_by_source": cb.by_source,
    }
    return cb.docs, info


# =========================================================================================
# Tokenizer
# =========================================================================================
def train_tokenizer(docs: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=2048,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    wrapped.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def encode_corpus(tok: PreTrainedTokenizerFast, docs: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents as `doc <|endoftext|> doc ...`; split train / held-out by doc hash."""
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    train_ids: list[int] = []
    held_ids: list[int] = []
    backend = tok.backend_tokenizer
    for start in range(0, len(docs), 512):
        chunk = docs[start:start + 512]
        for doc, enc in zip(chunk, backend.encode_batch(chunk, add_special_tokens=False)):
            h = int.from_bytes(hashlib.sha1(doc.encode("utf-8")).digest()[:4], "little")
            target = held_ids if h % HELDOUT_EVERY == 0 else train_ids
            target.extend(enc.ids)
            target.append(eot)
    return torch.tensor(train_ids, dtype=torch.int32), torch.tensor(held_ids, dtype=torch.int32)


# =========================================================================================
# Model and training
# =========================================================================================
def qwen3_config(eot: int, im_end: int, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int,
                 dtype: str) -> Qwen3Config:
    """The embedded model's architecture at a given size (this script's CPU model, or the GPU trainer's)."""
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=[eot, im_end],
        pad_token_id=eot,
        dtype=dtype,
    )


def make_config(tok: PreTrainedTokenizerFast) -> Qwen3Config:
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    return qwen3_config(eot, im_end, hidden=256, mlp=768, layers=4, heads=4, kv_heads=2, dtype="float32")


def lr_at(step: int, total: int) -> float:
    warmup = max(1, int(WARMUP_FRACTION * total))
    if step < warmup:
        return PEAK_LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return PEAK_LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch(data: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - SEQ_LEN - 1, (BATCH_SIZE,), generator=gen)
    return torch.stack([data[s:s + SEQ_LEN + 1] for s in starts.tolist()]).long()


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seed: int) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    losses = [lm_loss(model, batch(data, gen)).item() for _ in range(EVAL_BATCHES)]
    model.train()
    return sum(losses) / len(losses)


def train(model, train_ids: torch.Tensor, held_ids: torch.Tensor, steps: int) -> dict:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(SEED)
    model.train()
    history = []
    recent: list[float] = []
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        loss = lm_loss(model, batch(train_ids, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent.append(loss.item())
        if (step + 1) % LOG_EVERY == 0 or step == 0 or step + 1 == steps:
            avg = sum(recent) / len(recent)
            elapsed = time.time() - t0
            print(f"[train] step {step + 1:5d}/{steps}  loss {avg:.4f}  lr {lr_at(step, steps):.2e}  "
                  f"{elapsed:7.1f}s ({elapsed / (step + 1):.2f} s/step)", flush=True)
            history.append({"step": step + 1, "loss": round(avg, 4)})
            recent = []
    train_time = time.time() - t0
    return {
        "history": history,
        "train_seconds": round(train_time, 1),
        "seconds_per_step": round(train_time / max(1, steps), 3),
        "final_train_loss_last_window": history[-1]["loss"] if history else None,
    }


@torch.no_grad()
def samples(model, tok) -> dict[str, str]:
    model.eval()
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")
        gen = model.generate(**ids, max_new_tokens=40, do_sample=False)
        out[prompt] = tok.decode(gen[0], skip_special_tokens=False)
    return out


def make_portable(out: Path) -> None:
    """Let transformers 4.x (>= 4.51, the project's floor) read the files that 5.x wrote.

    5.x names the tokenizer class `TokenizersBackend`, stores extra special tokens as a list
    under `extra_special_tokens`, keeps the chat template only in chat_template.jinja and
    the RoPE base only in `rope_parameters`. The aliases below are read by both versions.
    Idempotent: running it again on its own output changes nothing.
    """
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = tc.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        tc["additional_special_tokens"] = extra
    tc["chat_template"] = CHAT_TEMPLATE
    tc["model_input_names"] = ["input_ids", "attention_mask"]  # 4.x would add token_type_ids
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", type=Path, default=REPO / "assets" / "tiny-qwen3")
    ap.add_argument("--dump-corpus", type=Path, help="write the corpus to this file and stop")
    args = ap.parse_args()

    wall0 = time.time()
    torch.manual_seed(SEED)
    print(f"[setup] torch {torch.__version__}, transformers {transformers.__version__}, "
          f"threads {torch.get_num_threads()}", flush=True)

    t = time.time()
    docs, corpus_info = build_corpus()
    print(f"[corpus] {corpus_info['documents']:,} documents, {corpus_info['bytes']:,} bytes "
          f"({time.time() - t:.0f}s)", flush=True)
    if args.dump_corpus:
        args.dump_corpus.write_text("\n<|endoftext|>\n".join(docs), encoding="utf-8")
        print(f"[corpus] written to {args.dump_corpus}")
        return

    t = time.time()
    tok = train_tokenizer(docs)
    # Byte-level BPE must round-trip arbitrary text.
    probe = "Return the value of x.\n    def f(a, b=2):  # naïve → café 🙂\n\tdone<|im_end|>"
    assert tok.decode(tok(probe)["input_ids"]) == probe, "tokenizer does not round-trip"
    train_ids, held_ids = encode_corpus(tok, docs)
    print(f"[tokenizer] vocab {len(tok)}, train tokens {len(train_ids):,}, held-out tokens "
          f"{len(held_ids):,}, {corpus_info['bytes'] / (len(train_ids) + len(held_ids)):.2f} bytes/token "
          f"({time.time() - t:.0f}s)", flush=True)

    config = make_config(tok)
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[model] Qwen3ForCausalLM, {n_params:,} parameters", flush=True)

    init_held = evaluate(model, held_ids, SEED + 1)
    stats = train(model, train_ids, held_ids, args.steps)
    train_loss = evaluate(model, train_ids, SEED + 2)
    held_loss = evaluate(model, held_ids, SEED + 1)
    print(f"[eval] held-out loss at init {init_held:.4f}; after training: train {train_loss:.4f}, "
          f"held-out {held_loss:.4f} (ppl {math.exp(held_loss):.1f})", flush=True)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=[eot, im_end], pad_token_id=eot, do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    make_portable(out)

    sample_text = samples(model, tok)
    for prompt, text in sample_text.items():
        print(f"[sample] {prompt!r} -> {text!r}", flush=True)

    wall = time.time() - wall0
    record = {
        "seed": SEED,
        "steps": args.steps,
        "batch_size": BATCH_SIZE,
        "seq_len": SEQ_LEN,
        "tokens_seen": args.steps * BATCH_SIZE * SEQ_LEN,
        "peak_lr": PEAK_LR,
        "parameters": n_params,
        "corpus": {**corpus_info, "train_tokens": len(train_ids), "heldout_tokens": len(held_ids)},
        "loss": {
            "heldout_at_init": round(init_held, 4),
            "train": round(train_loss, 4),
            "heldout": round(held_loss, 4),
            "eval_batches": EVAL_BATCHES,
        },
        "training": stats,
        "samples_greedy_40_tokens": sample_text,
        "wall_seconds_total": round(wall, 1),
        "threads": torch.get_num_threads(),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": __import__("tokenizers").__version__,
        },
        "command": "python -m lab.tinymodel.train",
    }
    (out / "TRAINING.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(f"[done] wrote {out} ({dir_size(out) / 1e6:.1f} MB) in {wall / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
