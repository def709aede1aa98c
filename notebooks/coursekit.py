"""Small helpers the course notebooks use: `setup()`, `HAS_GPU`, `tiny_model()`, `tiny_checkpoint()`,
`export_this()`, `zero_if_stub()`.

This file ships with the student release. It holds no exercise and no solution.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import random
import subprocess
import sys
from pathlib import Path

# jsonschema (which nbformat imports, and plotly's renderers import nbformat) loads rfc3987_syntax when it is
# installed (JupyterLab's dependencies install it), and that builds an IRI grammar for about a second at import.
# Nothing in a course kernel validates IRIs: without it every kernel starts a second sooner.
sys.modules.setdefault("rfc3987_syntax", None)

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
    _remember_cells()


def repo_root() -> Path:
    """The folder holding `minisgl/` and `assets/`: next to the notebooks, else the imported package's."""
    if ROOT is not None:
        return ROOT
    import minisgl

    return Path(minisgl.__file__).resolve().parent.parent


def h200_sections() -> dict[str, dict]:
    """The H200 measurements in reports/h200/*.json (the course's first full runs, which the notebooks' prose
    quotes; later leases are in the run*/ folders and in reports/h200/REPORT.md): for each section of lab/run.py,
    its newest result across those files, as {"result": ..., "file": ..., "environment": ...}."""
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


# --- exporting a notebook into the package ------------------------------------------------------------------
# What the kernel ran, by cell id (JupyterLab and VS Code send each cell's id with its code), so that an export
# can tell when the saved notebook is not what the student ran: `export_this` reads the file, not the editor.
_RAN: dict[str, str] = {}
STUB_MESSAGE = "exercise: see the notebook"  # how every exercise stub's NotImplementedError message begins


def _remember_cells() -> None:
    try:
        shell = get_ipython()  # noqa: F821 (defined inside IPython only)
    except NameError:
        return
    if _remember not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _remember)


def _remember(info) -> None:
    cell_id = getattr(info, "cell_id", None)
    if cell_id and info.raw_cell is not None:
        _RAN[cell_id] = info.raw_cell


def unsaved_cells(nb_path: Path) -> list[str]:
    """The export cells whose saved source differs from what this kernel last ran for the same cell:
    `cell N (`first line`)`. Empty when they agree, or when the front end sends no cell ids."""
    import nbformat

    bad = []
    for i, cell in enumerate(nbformat.read(nb_path, as_version=4).cells):
        ran = _RAN.get(cell.get("id") or "")
        if cell.cell_type == "code" and cell.source.startswith("#| export ") and ran is not None \
                and ran.rstrip() != cell.source.rstrip():
            first = next((ln for ln in cell.source.splitlines()[1:] if ln.strip()), "")
            bad.append(f"cell {i} (`{first.strip()[:60]}`)")
    return bad


def export_this(notebook: str) -> None:
    """Write this notebook's `#| export` cells into the package (`python autograder/course.py export NB`), so
    the next notebooks import your code, and reload what this kernel had imported of the package.

    The export reads the saved file: if an export cell you ran differs from its saved version (unsaved edits),
    it refuses and says which cell, rather than export what you did not run."""
    name = notebook if notebook.endswith(".ipynb") else notebook + ".ipynb"
    nb = Path.cwd() / name
    course = None if ROOT is None else ROOT / "autograder" / "course.py"
    if os.environ.get("MINISGL_COURSE_NO_EXPORT"):
        print(f"export of {name} skipped (MINISGL_COURSE_NO_EXPORT is set)")
        return
    if course is None or not course.exists() or not nb.exists() or nb.parent != ROOT / "notebooks":
        print(f"export of {name} skipped: not running inside a minisgl checkout's notebooks/ folder")
        return
    unsaved = unsaved_cells(nb)
    if unsaved:
        raise RuntimeError(
            f"nothing exported: the saved {name} differs from what you ran in {', '.join(unsaved)}. Save the "
            f"notebook (Ctrl+S), or run those cells again if you changed them after running, then run this cell.")
    before = {m: _text(ROOT / m) for m in _exported_modules(nb)}
    out = subprocess.run([sys.executable, str(course), "export", name], capture_output=True, text=True)
    print(out.stdout + out.stderr, end="")
    if out.returncode:
        raise RuntimeError(f"export failed (exit {out.returncode})")
    changed = [m for m, text in before.items() if _text(ROOT / m) != text]
    reloaded, rebound = reload_package(changed)
    if reloaded:
        print(f"reloaded in this kernel: {', '.join(reloaded)}"
              + (f"; these names now refer to the new code: {', '.join(rebound)}" if rebound else "")
              + ". Objects made before the export (an engine, a cache) still run the old code: make them again.")


def _text(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def _exported_modules(nb_path: Path) -> list[str]:
    import nbformat

    return [c.source.partition("\n")[0][len("#| export "):].strip() for c in nbformat.read(nb_path, as_version=4).cells
            if c.cell_type == "code" and c.source.startswith("#| export ")]


def _imported_names(module) -> set[str]:
    """Every `minisgl...` module name the source of `module` imports (anywhere in it, lazily or not)."""
    try:
        tree = ast.parse(Path(module.__file__).read_text())
    except (OSError, SyntaxError, TypeError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n == "minisgl" or n.startswith("minisgl.")}


def reload_package(changed: list[str]) -> tuple[list[str], list[str]]:
    """After an export rewrote `changed` (paths `minisgl/...py`): re-import every loaded `minisgl` module that is
    one of them or imports one (transitively), so the next cell runs the new code, and point the names of
    this kernel's namespace that came from those modules (`from minisgl.x import Y`) at the new objects.
    Returns (the modules re-imported, the names rebound)."""
    names = {m[:-3].replace("/", ".").removesuffix(".__init__") for m in changed}
    loaded = {n: m for n, m in sys.modules.items() if (n == "minisgl" or n.startswith("minisgl.")) and m is not None}
    imports = {n: _imported_names(m) for n, m in loaded.items()}
    stale = names & loaded.keys()
    while True:  # a module that imports a stale one is stale too
        more = {n for n in loaded if n not in stale and imports[n] & stale}
        if not more:
            break
        stale |= more
    if not stale:
        return [], []
    old = {n: sys.modules.pop(n) for n in stale}
    importlib.invalidate_caches()
    for n in sorted(stale, key=lambda n: n.count(".")):  # packages first; each import pulls in what it needs
        if n not in sys.modules:
            importlib.import_module(n)
    for n in list(sys.modules):  # a re-imported package must still hold its submodules as attributes
        parent, _, child = n.rpartition(".")
        if parent in stale and n.startswith("minisgl.") and sys.modules.get(parent) is not None:
            setattr(sys.modules[parent], child, sys.modules[n])
    return sorted(stale), _rebind(old)


def _rebind(old: dict) -> list[str]:
    """Names in the IPython user namespace that are an old module, or an object defined in one: the new one."""
    try:
        user_ns = get_ipython().user_ns  # noqa: F821
    except NameError:
        return []
    rebound = []
    for name, value in list(user_ns.items()):
        if name.startswith("_"):
            continue
        new = None
        if any(value is m for m in old.values()):
            new = sys.modules.get(value.__name__)
        else:
            mod, qual = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
            if isinstance(mod, str) and mod in old and isinstance(qual, str) and mod in sys.modules:
                new = sys.modules[mod]
                for part in qual.split("."):
                    new = getattr(new, part, None)
        if new is not None and new is not value:
            user_ns[name] = new
            rebound.append(name)
    return rebound


@contextlib.contextmanager
def zero_if_stub(exercise: str):
    """For a graded cell that Run All must pass over while `exercise` is still the stub (the tour's warm-up):
    the stub's NotImplementedError becomes a line on stderr, which nbgrader scores as 0 points, instead of an
    error that stops the notebook there. Any other error (a wrong answer) still raises."""
    try:
        yield
    except NotImplementedError as e:
        if not str(e).startswith(STUB_MESSAGE):
            raise
        print(f"{exercise} is still the exercise stub: this test scores 0 points. Write it in the cell above, run "
              f"that cell, then this one.", file=sys.stderr)


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
