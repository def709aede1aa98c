"""Small helpers the course notebooks use: `setup()`, `HAS_GPU`, `tiny_model()`, `tiny_checkpoint()`, `export_this()`.

This file ships with the student release. It holds no exercise and no solution.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The repository (or student release) this notebooks folder belongs to, when it has one: notebooks import
# the `minisgl` package that sits next to them, so a release works even before `pip install -e .`.
ROOT = HERE.parent if (HERE.parent / "minisgl").is_dir() else None
HAS_GPU = False


def setup(seed: int = 0, threads: int = 1) -> None:
    """One torch thread (tiny models: threads cost more than they save), seeds, the plotly renderer."""
    global HAS_GPU
    if ROOT is not None and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    HAS_GPU = torch.cuda.is_available()
    try:
        import plotly.io as pio

        # JupyterLab / VS Code render the mimetype; classic Notebook and nbviewer load plotly.js from the CDN.
        pio.renderers.default = "plotly_mimetype+notebook_connected"
    except ImportError:  # plotly is in the `course` extra
        pass


def repo_root() -> Path:
    """The folder holding `minisgl/` and `assets/`: next to the notebooks, else the imported package's."""
    if ROOT is not None:
        return ROOT
    import minisgl

    return Path(minisgl.__file__).resolve().parent.parent


def h200_sections() -> dict[str, dict]:
    """The H200 measurements in reports/h200/: for each section of lab/run.py, its newest result
    across the results files, as {"result": ..., "file": ..., "environment": ...} (as the report reads them)."""
    from minisgl.bench.runner import newest_sections

    return newest_sections(repo_root() / "reports" / "h200")


def _has_weights(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def tiny_model() -> str:
    """Path of a tiny Qwen3 checkpoint with a tokenizer: the embedded `assets/tiny-qwen3` when the repository
    has it, else a random one built once with transformers (`save_pretrained`) in ~/.cache/minisgl-course."""
    asset = repo_root() / "assets" / "tiny-qwen3"
    if _has_weights(asset):
        return str(asset)
    cache = Path(os.environ.get("MINISGL_COURSE_CACHE", Path.home() / ".cache" / "minisgl-course"))
    path = cache / "tiny-qwen3-random"
    if not _has_weights(path) or not (path / "tokenizer.json").exists():
        _build_random_tiny_qwen3(path)
    return str(path)


def _build_random_tiny_qwen3(path: Path, vocab: int = 512) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    # A word-level tokenizer: token i <-> the word "w{i}".
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


# Rope settings that exercise all three Llama-3 bands with head_dim 16 (original context 64, prompts past it).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def tiny_hf_config(arch: str, vocab: int = 512):
    """A tiny config of `arch`: qwen3 (q/k norm, tied embeddings), llama (Llama-3 rope scaling), qwen2 (q/k/v
    biases). Hidden 64, 2 layers, 4 query heads sharing 2 KV heads."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)
    if arch == "llama":
        return LlamaConfig(rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False, **common)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=False, **common)
    raise ValueError(arch)


def tiny_checkpoint(arch: str, seed: int = 0) -> str:
    """A random tiny HF checkpoint of `arch` saved with `save_pretrained` (safetensors), built once per machine.

    Biases and norm weights are randomised too (HF initialises them to 0 and 1, which would hide a loader
    that drops a bias or a norm applied to the wrong tensor)."""
    import torch
    from transformers import AutoModelForCausalLM

    cache = Path(os.environ.get("MINISGL_COURSE_CACHE", Path.home() / ".cache" / "minisgl-course"))
    path = cache / f"tiny-{arch}-{seed}"
    if _has_weights(path):
        return str(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(arch)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def export_this(notebook: str) -> None:
    """Write this notebook's `#| export` cells into the package (`python autograder/course.py export NB`),
    so the next notebooks import your code. Save the notebook first (Ctrl+S): the export reads the file."""
    name = notebook if notebook.endswith(".ipynb") else notebook + ".ipynb"
    nb = Path.cwd() / name
    course = None if ROOT is None else ROOT / "autograder" / "course.py"
    if os.environ.get("MINISGL_COURSE_NO_EXPORT"):
        print(f"export of {name} skipped (MINISGL_COURSE_NO_EXPORT is set)")
        return
    if course is None or not course.exists() or not nb.exists() or nb.parent != ROOT / "notebooks":
        print(f"export of {name} skipped: not running inside a minisgl checkout's notebooks/ folder")
        return
    out = subprocess.run([sys.executable, str(course), "export", name], capture_output=True, text=True)
    print(out.stdout + out.stderr, end="")
    if out.returncode:
        raise RuntimeError(f"export failed (exit {out.returncode})")


# --- the tour's recording ---------------------------------------------------------------------------------
# The tour (00) drives the finished engine. In a fresh release the package is all exercise stubs, so the
# tour falls back to a run of the reference engine recorded by lab/course/record_tour.py (data only: texts,
# token ids, per-step batch composition inputs and timings), and says so.

TOUR_TRACE = "assets/tour_trace.json"


class TourRecording:
    """The recorded tour: `outputs(section)` gives objects with the fields of `minisgl.RequestOutput` that
    the tour reads, `steps()` the recorded per-step records, `seconds(section)` the wall time of a run."""

    def __init__(self, data: dict, reason: str = "") -> None:
        self.data, self.reason = data, reason

    def outputs(self, section: str) -> list:
        from types import SimpleNamespace

        return [SimpleNamespace(**o) for o in self.data["sections"][section]["outputs"]]

    def steps(self, section: str = "steps") -> list[dict]:
        return [dict(s) for s in self.data["sections"][section]["steps"]]

    def composition(self, section: str = "steps") -> list[tuple[int, int]]:
        """(prefill tokens, decode tokens) per recorded step, as the reference `composition` computed them."""
        return [tuple(c) for c in self.data["sections"][section]["composition"]]

    def seconds(self, section: str) -> float:
        return self.data["sections"][section]["seconds"]

    def banner(self) -> str:
        s = self.data["settings"]
        return (f"[recorded] Your minisgl package cannot run yet ({self.reason}).\n"
                f"[recorded] Shown instead: the reference engine's run recorded {self.data['recorded_at']} at commit "
                f"{self.data['commit'][:10]} on {s['device']} (torch {s['torch']}, model {s['model']}).\n"
                f"[recorded] Finish the notebooks and these cells run your own engine.\n")


def tour_recording(error: BaseException | None = None) -> TourRecording:
    """Load the recorded tour; `error` (the NotImplementedError the live engine raised) says where it stopped."""
    import json
    import traceback

    reason = ""
    if error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        where = next((f for f in reversed(frames) if "minisgl" in f.filename), frames[-1] if frames else None)
        reason = f"{type(error).__name__}: {error}"
        if where is not None:
            path = Path(where.filename)
            rel = "/".join(path.parts[path.parts.index("minisgl"):]) if "minisgl" in path.parts else path.name
            reason += f" in {where.name}() of {rel}"
    data = json.loads((repo_root() / TOUR_TRACE).read_text())
    return TourRecording(data, reason)
