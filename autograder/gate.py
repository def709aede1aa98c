"""The release gate: the course walked as a student walks it, one notebook at a time, in one release.

For k = 0, 1, ...: in a release where notebooks 0..k-1 hold the reference solutions and were exported (a
student who finished them), notebook k runs top to bottom (errors allowed, recorded). Every graded cell must
fail, and every error must be one the student is responsible for: the exercise stub's NotImplementedError
raised by *this* notebook's code (an exercise cell, or a demo cell that calls this notebook's exercise), or
a NameError for a name that an earlier failing cell of the notebook would have defined. Anything else is a
problem a student would hit without having done anything wrong: an ImportError, any other exception, or a
stub raised from the package (a module of an earlier notebook that did not export, or of a later notebook
that this one must not need yet). Run All (stop at the first error) on it must stop only in an exercise or
graded cell of its own, on the stub: the first error of the run above is where Run All stops; the tour
(RUNS_TO_THE_END) must not stop at all. A graded cell fails when nbgrader scores it 0: an error, or output
on stderr. Then notebook k is filled with the reference solution and runs again:
every cell must pass, and its last cell (`coursekit.export_this`) writes the student's modules into the
release package for notebook k+1. `course.py roundtrip` then autogrades the filled notebooks (full marks).

Used by `course.py roundtrip` (and so by tests/test_course.py) and by lab/course/h200.py (`execute`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

STUB_ERROR = ("NotImplementedError", "exercise: see the notebook")  # every stub's message begins so
# Notebooks that Run All must take to their end even before their exercise is done: the tour is the first
# thing a student runs, and what it shows below its warm-up exercise is the point of it.
RUNS_TO_THE_END = ("00_tour.ipynb",)


def is_stub_error(ename: str, evalue: str) -> bool:
    """An exercise stub raised: the notebook's own (`exercise: see the notebook`) or a package module's, whose
    message goes on to name the notebook and exercise (course.py export)."""
    return ename == STUB_ERROR[0] and evalue.startswith(STUB_ERROR[1])


def kernel_spec_dir(python: str = sys.executable) -> Path:
    """A Jupyter data dir with one kernel spec, `minisgl-course`, that starts `python` (this interpreter by
    default), so the notebooks run in the same environment as the caller whatever kernels are installed."""
    root = Path(tempfile.mkdtemp(prefix="minisgl-kernel-"))
    spec = root / "kernels" / "minisgl-course"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "minisgl course", "language": "python"}))
    return root


@dataclass
class CellError:
    index: int
    kind: str  # "solution <grade_id>", "graded <grade_id>" or "cell"
    ename: str
    evalue: str
    raised_in: str = ""  # the file of the innermost frame ("" for the notebook's own cells)
    cause: str = ""  # for a NameError: the earlier failing cell that would have defined the name

    def __str__(self) -> str:
        return f"cell {self.index} ({self.kind}): {self.ename}: {self.evalue[:300]}"


@dataclass
class Run:
    notebook: str
    seconds: float
    errors: list[CellError] = field(default_factory=list)
    timed_out: str = ""
    graded: list[str] = field(default_factory=list)  # grade_ids of the notebook's graded cells
    cpu_seconds: float | None = None  # the kernel's CPU time (and its reaped children's); None where unknown
    stderr: dict[int, str] = field(default_factory=dict)  # graded cell index -> what it wrote to stderr
    kinds: dict[int, str] = field(default_factory=dict)  # graded cell index -> cell_kind

    def failed_graded(self) -> set[str]:
        """grade_ids of the graded cells nbgrader scores 0: an error, or anything written to stderr."""
        return {e.kind.split(" ", 1)[1] for e in self.errors if e.kind.startswith("graded")} | \
            {self.kinds[i].split(" ", 1)[1] for i in self.stderr}

    def run_all_stop(self) -> CellError | None:
        """Where Run All (stop at the first error) stops: the first error; None when it runs to the end. The
        cells before it ran exactly as in this run (errors allowed), so this is Run All's outcome."""
        return min(self.errors, key=lambda e: e.index, default=None)


def cell_kind(cell) -> str:
    meta = cell.metadata.get("nbgrader", {})
    if meta.get("solution"):
        return f"solution {meta['grade_id']}"
    if meta.get("grade"):
        return f"graded {meta['grade_id']}"
    return "cell"


def execute(path: Path, env: dict | None = None, timeout: int = 300, kernel_dir: Path | None = None,
            save: Path | None = None) -> Run:
    """Run the notebook at `path` top to bottom in its own folder with every error recorded (not raised);
    `save` writes the executed notebook there. `env` replaces the kernel's environment."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ if env is None else env)
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    kernel = "minisgl-course" if kernel_dir is not None else "python3"
    # the kernel spec from kernel_dir, found without touching this process's JUPYTER_PATH (threads share it)
    specs = {} if kernel_dir is None else {
        "kernel_spec_manager": KernelSpecManager(kernel_dirs=[str(Path(kernel_dir) / "kernels")])}
    # IPC sockets, not TCP: kernels started at once by parallel jobs cannot race for the same free ports
    sockets = Path(tempfile.mkdtemp(prefix="minisgl-ipc-"))  # own folder: the socket files are named <ip>-N
    km = KernelManager(kernel_name=kernel, transport="ipc", ip=str(sockets / "kernel"), **specs)
    client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=True, kernel_name=kernel,
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    timed_out = ""
    try:
        client.execute(env=env, cwd=str(path.parent))
    except (CellTimeoutError, DeadKernelError) as e:
        timed_out = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        cpu = _cpu_seconds(km)
        if km.has_kernel:  # nbclient shuts down only kernels it created itself, not one handed to it
            km.shutdown_kernel(now=True)
        shutil.rmtree(sockets, ignore_errors=True)
    run = Run(path.name, round(time.perf_counter() - t0, 1), timed_out=timed_out, cpu_seconds=cpu)
    run.graded = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade"):
            run.kinds[i] = cell_kind(cell)
            err = "".join(o.get("text", "") for o in cell.get("outputs", [])
                          if o.get("output_type") == "stream" and o.get("name") == "stderr")
            if err:
                run.stderr[i] = err
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                run.errors.append(CellError(i, cell_kind(cell), out.get("ename", ""), out.get("evalue", ""),
                                            raised_in=_innermost_file(out.get("traceback", []))))
    failed_sources = {}
    for err in run.errors:  # a NameError downstream of a failed cell is that cell's consequence
        if err.ename == "NameError":
            name = re.search(r"name '(\w+)' is not defined", err.evalue)
            for j, src in failed_sources.items():
                if name and re.search(rf"\b{name.group(1)}\b\s*(,[^=]*)?=|def {name.group(1)}\b|"
                                      rf"for [^:]*\b{name.group(1)}\b", src):
                    err.cause = f"cell {j}"
                    break
        failed_sources[err.index] = nb.cells[err.index].source
    if save is not None:
        Path(save).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, save)
    return run


def _cpu_seconds(km) -> float | None:
    """CPU seconds the kernel process has used (user + system, its reaped children's included), from Linux's
    /proc: what a notebook costs, whatever else the machine runs meanwhile. None elsewhere."""
    process = getattr(getattr(km, "provisioner", None), "process", None)
    try:
        fields = Path(f"/proc/{process.pid}/stat").read_text().rpartition(")")[2].split()
        return round(sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK"), 1)
    except (AttributeError, OSError, ValueError, IndexError):
        return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FRAME = re.compile(r"File (/[^\s:]+\.py):\d+|(Cell In\[\d+\])|File \"?([^\s\",:]+\.py)\"?, line \d+")


def _innermost_file(traceback: list[str]) -> str:
    """The source file of the innermost frame of an IPython traceback ("" when it is a notebook cell)."""
    last = ""
    for entry in traceback:
        for m in _FRAME.finditer(_ANSI.sub("", entry)):
            last = "" if m.group(2) else (m.group(1) or m.group(3))
    if "/ipykernel_" in last:  # a cell's code as IPython files it
        return ""
    return last


def fill(released: Path, source: Path) -> int:
    """Write the reference solution into the released notebook at `released` (in place): every solution
    cell gets the source notebook's cell of the same grade_id, solution marker lines dropped (what a student
    types has none). Returns the number of cells filled."""
    src = {c.metadata["nbgrader"]["grade_id"]: c.source for c in nbformat.read(source, as_version=4).cells
           if c.metadata.get("nbgrader", {}).get("solution")}
    nb = nbformat.read(released, as_version=4)
    n = 0
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if cell.metadata.get("nbgrader", {}).get("solution") and gid in src:
            lines = [ln for ln in src[gid].split("\n") if ln.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION")]
            cell.source = "\n".join(lines)
            n += 1
    if n != len(src):
        raise RuntimeError(f"{released.name}: filled {n} of {len(src)} solution cells")
    nbformat.write(nb, released)
    return n


def unexpected(run: Run, owners: dict[str, str]) -> list[str]:
    """Errors a student who finished the earlier notebooks must not see in this one (module docstring).
    `owners`: package module path (minisgl/...) -> the notebook that exports it."""
    bad = []
    for e in run.errors:
        if e.ename == "NameError" and e.cause:
            continue
        if not is_stub_error(e.ename, e.evalue):
            bad.append(f"{run.notebook}: {e}")
            continue
        if e.raised_in:  # a stub in the package: fine only if this notebook owns that module
            module = e.raised_in[e.raised_in.rfind("minisgl/"):] if "minisgl/" in e.raised_in else e.raised_in
            owner = owners.get(module)
            if owner != run.notebook:
                bad.append(f"{run.notebook}: {e} -- raised by the stub in {module}"
                           + (f" (the exercise of {owner})" if owner else ""))
    if run.timed_out:
        bad.append(f"{run.notebook}: {run.timed_out}")
    return bad


def run_all_problems(run: Run, owners: dict[str, str]) -> list[str]:
    """Run All on the notebook as released (0..k-1 done): it may stop only at its own exercise, in an exercise
    or graded cell of this notebook raising the stub, never in a demo cell or on another notebook's stub. A
    notebook in RUNS_TO_THE_END must run to its end."""
    stop = run.run_all_stop()
    if stop is None:
        return []
    where = f"{run.notebook}: Run All stops at {stop}"
    if run.notebook in RUNS_TO_THE_END:
        return [f"{where}: this notebook must run to its end (a graded cell whose exercise is still the stub "
                f"can say so on stderr and score 0 instead: coursekit.zero_if_stub)"]
    if stop.kind == "cell":
        return [f"{where}: not an exercise or graded cell (only those may stop a notebook before its exercises)"]
    if not is_stub_error(stop.ename, stop.evalue):
        return [f"{where}: not the exercise stub"]
    if stop.raised_in:
        module = stop.raised_in[stop.raised_in.rfind("minisgl/"):] if "minisgl/" in stop.raised_in else stop.raised_in
        if owners.get(module) != run.notebook:
            return [f"{where}: raised by the stub in {module}, not this notebook's"]
    return []


@dataclass
class Gate:
    stubbed: dict[str, Run] = field(default_factory=dict)  # notebook k with 0..k-1 filled
    filled: dict[str, Run] = field(default_factory=dict)  # notebook k with 0..k filled
    owners: dict[str, str] = field(default_factory=dict)  # minisgl/... module -> notebook file name

    def problems(self) -> list[str]:
        bad = []
        for name, run in self.stubbed.items():
            bad += [f"before the exercises, {x}" for x in unexpected(run, self.owners)]
            bad += [f"before the exercises, {x}" for x in run_all_problems(run, self.owners)]
            bad += [f"before the exercises, {name}: graded cell {g} passes on the stubs"
                    for g in sorted(set(run.graded) - run.failed_graded())]
        for name, run in self.filled.items():
            bad += [f"with the solutions, {name}: {e}" for e in run.errors]
            bad += [f"with the solutions, {name}: graded cell {i} writes to stderr (nbgrader scores it 0): "
                    f"{text[:200]!r}" for i, text in run.stderr.items()]
            if run.timed_out:
                bad.append(f"with the solutions, {name}: {run.timed_out}")
        return bad

    def as_json(self) -> dict:
        def dump(r: Run) -> dict:
            stop = r.run_all_stop()
            return {"seconds": r.seconds, "cpu_seconds": r.cpu_seconds, "timed_out": r.timed_out,
                    "run_all_stops_at": str(stop) if stop else "the end",
                    "errors": [str(e) + (f" [after {e.cause}]" if e.cause else "")
                               + (f" [in {e.raised_in}]" if e.raised_in else "") for e in r.errors]}
        return {"stubbed": {k: dump(v) for k, v in self.stubbed.items()},
                "filled": {k: dump(v) for k, v in self.filled.items()}}


def export_one(release_dir: Path, name: str) -> None:
    """What the notebook's last cell does (`coursekit.export_this`): the release's own course.py export."""
    out = subprocess.run([sys.executable, str(Path(release_dir) / "autograder" / "course.py"), "export", name],
                         cwd=Path(release_dir) / "notebooks", capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"export of {name} failed:\n{out.stdout}{out.stderr}")


def walk(release_dir: Path, source_dir: Path, notebooks: list[Path], owners: dict[str, str],
         timeout: int = 300, log=None) -> Gate:
    """The progressive pass over the release in `release_dir` (changed in place: its notebooks end filled
    and exported). `notebooks` are the release's notebook paths in order; `source_dir` has the reference;
    `owners` maps each generated module (minisgl/...) to the notebook file that exports it."""
    gate = Gate(owners=dict(owners))
    kernels = kernel_spec_dir()
    env = {k: v for k, v in os.environ.items() if k not in ("MINISGL_COURSE_NO_EXPORT", "PYTHONPATH")}
    env["PYTHONPATH"] = str(release_dir)  # the student's package, never the repository's
    def note(kind: str, run: Run) -> None:
        if log is not None:
            log.write(f"{kind} {run.notebook}: {run.seconds} s, {len(run.errors)} error(s)\n"
                      + "".join(f"  {e}\n" for e in run.errors if kind == "filled"))

    # Two kernels at a time: once notebook k is filled and exported, "k filled" and "k+1 before its
    # exercises" need the same package (0..k exported), so they run side by side. k's own export cell then
    # rewrites nothing (same text), so the two never race on a file.
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(2) as pool:
            if notebooks:
                gate.stubbed[notebooks[0].name] = run = execute(notebooks[0], env, timeout, kernels)
                note("stubbed", run)
            for k, nb in enumerate(notebooks):
                fill(nb, Path(source_dir) / nb.name)
                export_one(release_dir, nb.name)
                filled = pool.submit(execute, nb, env, timeout, kernels)
                nxt = notebooks[k + 1] if k + 1 < len(notebooks) else None
                stubbed = pool.submit(execute, nxt, env, timeout, kernels) if nxt is not None else None
                gate.filled[nb.name] = run = filled.result()
                note("filled", run)
                if stubbed is not None:
                    gate.stubbed[nxt.name] = run = stubbed.result()
                    note("stubbed", run)
    finally:
        shutil.rmtree(kernels, ignore_errors=True)
    return gate
