"""A small model for the server's tests: the shipped demo model when it is there, else a random one.

`assets/tiny-qwen3/` (trained by lab/tinymodel/train.py) counts as present once its TRAINING.json
exists, the file that script writes last. Otherwise `build_random_model(folder)` writes a tiny Qwen3 with
seeded random weights and a byte-level BPE tokenizer (with a ChatML chat template) trained on a few
sentences in several scripts, so multi-byte UTF-8 characters are split across tokens. The weights are
scaled up so logits are far apart and greedy decoding does not hinge on rounding.
"""

from __future__ import annotations

import os
from pathlib import Path

from minisgl.environment import server_test_model

REPO = Path(__file__).resolve().parents[2]
ASSET = REPO / "assets" / "tiny-qwen3"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "A server streams tokens to many clients; each client reads its own stream of text.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e na\u00efve r\u00e9sum\u00e9 fa\u00e7ade \u00fcber Stra\u00dfe.",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3068\u4e2d\u6587\u7684\u53e5\u5b50\u3002\u6f22\u5b57\u3068\u304b\u306a\u3002",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0394\u03b5\u03b9\u03b3\u03bc\u03b1 "
    "\u03ba\u03b5\u03b9\u03bc\u03ad\u03bd\u03bf\u03c5.",
    "Emoji: \U0001f600 \U0001f680 \U0001f44d\U0001f3fd and symbols \u2192 \u2264 \u221e \u20ac.",
    "def main():\n    return [i * i for i in range(10)]\n",
    "Numbers 0123456789, punctuation !?.,;: and (brackets) [lists] {sets}.",
]


def asset_ready(path: Path = ASSET) -> bool:
    return (path / "TRAINING.json").exists() and (path / "config.json").exists() and (
        path / "tokenizer.json").exists()


def build_tokenizer(model_max_length: int = 512):
    """A byte-level BPE tokenizer (vocabulary 400) with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1,
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                      model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    wrapped.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_random_model(folder: str | os.PathLike, seed: int = 0, max_position_embeddings: int = 512) -> str:
    """Write a tiny random Qwen3 with a tokenizer into `folder`; returns its path."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    wrapped = build_tokenizer(max_position_embeddings)
    eot = wrapped.convert_tokens_to_ids("<|endoftext|>")
    im_end = wrapped.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(vocab_size=len(wrapped), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=eot, eos_token_id=[eot, im_end],
                         pad_token_id=eot, initializer_range=0.2)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():
        # A random model emits EOS about 2/vocab of the time; make it rarer so streams run long.
        model.model.embed_tokens.weight[[eot, im_end]] *= 0.05
    model.save_pretrained(folder, safe_serialization=True)
    wrapped.save_pretrained(folder)
    return str(folder)


def tiny_model_path(scratch: str | os.PathLike) -> str:
    """The demo model when it is ready, else a random one built (once) under `scratch`."""
    if server_test_model():
        return server_test_model()
    if asset_ready():
        return str(ASSET)
    return build_random_model(Path(scratch) / "tiny-random-qwen3")
