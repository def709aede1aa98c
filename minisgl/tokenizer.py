"""A model folder's tokenizer: the offline API, the server's front, the engine's grammar compiler and the
notebooks load it the same way."""

from __future__ import annotations

import os


def load_tokenizer(path: str):
    """The model folder's tokenizer, or None when it has none (dummy-weight configs)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                              "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
