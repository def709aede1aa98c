# generated from notebooks/01_model.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/01_model.ipynb, cell 7 (id c01-006a) ---
"""The files of a checkpoint folder (Hugging Face layout): one module of its own, so every model's weight reader
(the decoder's in loader.py, Qwen3.5's in models/qwen3_5.py) imports it without importing the other."""

from __future__ import annotations

import json
import os


# --- notebooks/01_model.ipynb, cell 37 (id c01-034a) ---
def checkpoint_files(path: str) -> list[str]:
    """The .safetensors files of a checkpoint folder: the ones its index names, or else every one there."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files
