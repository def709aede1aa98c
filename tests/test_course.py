"""The course mechanics (notebooks/CONVENTIONS.md): notebooks are the source of the modules they teach,
every notebook runs top to bottom on a CPU, and the nbgrader release round trip holds.

- `test_modules_match_notebooks`: `course.py check` (a committed module differs from its notebook -> diff).
- `test_release_roundtrip` and `test_notebook_walk[NN_x]` share one release (`course.roundtrip`):
  - the release gate (autograder/gate.py), TinyTorch style: for k = 00..10, with notebooks 00..k-1 filled
    with the reference solutions and exported (a student who finished them), notebook k runs top to bottom
    with nbclient and fails only with its own exercise's NotImplementedError (every graded cell fails); with
    k filled, every cell passes, within 3 minutes, and its last cell exports it for k+1;
  - the walked notebooks are autograded (full marks, no cell raising) and the untouched release too (zero),
    in parallel; no solution text in the release, no graded cell passing on the stubs, no hidden test in the
    feedback, the release package imports with every exercise a stub.
  Outputs are never compared (timings, plotly JSON and widget ids change from run to run; correctness lives
  in the notebooks' test cells). This replaced nbval of the reference notebooks, which the walk's filled
  runs and the autograde of the reference repeated.
  `test_run_all_untouched[NN_x]`: Run All on the gate's run of NN before its exercises stops only in an
  exercise or graded cell of its own (00: runs to its end). `test_feedback_embeds_plotly`,
  `test_release_speaks_to_students`: the feedback opens offline; the release's README, JupyterLab settings
  and `pytest` (a progress report) are the students'.
- `test_export_reaches_a_kernel_that_imported_the_stubs`: `coursekit.export_this` in a live kernel refuses
  unsaved edits, and once saved, the next cell runs the exported code.
- `test_tour_recording_is_current`: assets/tour_trace.json matches the tour and the model.

With `-n 2` (pytest-xdist), the round-trip tests form one group (`xdist_group("roundtrip")`, one worker); the
rest of the file runs on the other worker.

All of it runs in `python -m pytest` (CI); `-m "not slow"` leaves out the slow parts while you edit.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The course tooling needs the `course` extra (pip install -e ".[course]"); without it, skip, don't fail.
_MISSING = [m for m in ("nbformat", "nbclient", "nbgrader", "nbval", "plotly", "ipywidgets", "ipykernel")
            if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(f"the course extra is not installed (missing {', '.join(_MISSING)}): pip install -e '.[course]'",
                allow_module_level=True)

import nbformat  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "autograder"))

import course  # noqa: E402

NOTEBOOKS = course.notebook_paths()
CDN_PLOTLY = re.compile(r"""(src=|import )["']https://cdn\.plot\.ly""")  # a page that loads plotly.js from its CDN


def test_modules_match_notebooks():
    diffs = course.check()
    assert not diffs, "modules differ from their notebooks (run `python autograder/course.py export`):\n" + \
        "\n".join(diffs)


def test_every_notebook_is_clean_and_well_formed():
    """Committed without outputs; export cells name a module; grade ids unique; graded cells are locked."""
    ids = {}
    for nb_path in NOTEBOOKS:
        nb = nbformat.read(nb_path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, \
                    f"{nb_path.name}: commit notebooks without outputs (`python autograder/course.py clean`)"
            meta = cell.metadata.get("nbgrader")
            if not meta:
                assert "### BEGIN SOLUTION" not in cell.source, f"{nb_path.name}: solution region w/o metadata"
                continue
            gid = meta["grade_id"]
            assert gid not in ids, f"grade_id {gid} in {nb_path.name} and {ids[gid]}"
            ids[gid] = nb_path.name
            assert meta.get("schema_version") == 3
            if meta.get("grade"):
                assert meta.get("locked") and meta.get("points", 0) > 0, f"{gid}: graded cells are locked"
                assert "### BEGIN SOLUTION" not in cell.source


def test_render_module_rules(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell('#| export minisgl/x.py\n"""doc."""\n\nimport os\n'),
        nbformat.v4.new_code_cell("print('not exported')"),
        nbformat.v4.new_code_cell("#| export minisgl/x.py\n\ndef f():\n    ### BEGIN SOLUTION\n    return 1\n"
                                  "    ### END SOLUTION\n"),
    ]
    nbformat.write(nb, tmp_path / "07_demo.ipynb")
    text = course.generate(tmp_path)["minisgl/x.py"]
    first, last = (f"# --- notebooks/07_demo.ipynb, cell {i} (id {nb.cells[i].id}) ---\n" for i in (0, 2))
    assert text == (course.HEADER.format(nb="07_demo.ipynb")
                    + first + '"""doc."""\n\nimport os\n\n\n' + last + 'def f():\n    return 1\n')


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory):
    """One release for the whole module: the gate walks it, the walked and the untouched notebooks are graded."""
    work = tmp_path_factory.mktemp("roundtrip")
    t0 = time.perf_counter()
    with open(work / "roundtrip.log", "w") as log:
        rt = course.roundtrip(work, log=log)
    print(f"round trip with the release gate: {time.perf_counter() - t0:.0f} s {rt.seconds}")
    return rt, work


@pytest.mark.xdist_group("roundtrip")
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_walk(nb, roundtrip):
    """The release gate for notebook NN: with 00..NN-1 done, it fails only on its own exercise's stubs (and
    every graded cell fails); with NN done too, every cell passes (within the 3-minute budget) and exports."""
    import gate

    rt, _ = roundtrip
    before, after = rt.gate.stubbed[nb.name], rt.gate.filled[nb.name]
    print(f"{nb.name}: {before.seconds:.0f} s before the exercises, {after.seconds:.0f} s with them "
          f"({after.cpu_seconds} s of CPU)")
    bad = gate.unexpected(before, rt.gate.owners)
    assert not bad, "errors a student who finished the earlier notebooks would hit:\n" + "\n".join(bad)
    failed = before.failed_graded()  # an error, or stderr (nbgrader scores either 0)
    assert set(before.graded) <= failed, f"graded cells passing on the stubs: {set(before.graded) - failed}"
    assert not after.errors and not after.timed_out, \
        f"{nb.name} with the reference solution:\n" + "\n".join(map(str, after.errors)) + after.timed_out
    # the budget is the notebook's own cost, its kernel's CPU time (one torch thread: about its wall time on an
    # idle machine), not the wall time of a run that shares the cores with the rest of the suite
    cost = after.cpu_seconds if after.cpu_seconds is not None else after.seconds
    assert cost < 180, f"{nb.name} took {cost:.0f} s of CPU; the budget is 3 minutes on a 2-core CPU"


def test_no_pinned_outputs():
    """CI executes the notebooks with nbclient (the release gate) and compares no outputs: nothing may rely on
    nbval's `# NBVAL_CHECK_OUTPUT` (or skip a cell with `# NBVAL_SKIP`)."""
    for nb_path in NOTEBOOKS:
        for cell in nbformat.read(nb_path, as_version=4).cells:
            assert "NBVAL_" not in cell.source, f"{nb_path.name}: nbval markers are not honoured any more"


@pytest.mark.slow
def test_graders_pass_on_the_reference():
    """autograder/graders on the reference package: everything passes (the GPU bars skip on a CPU)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "autograder/graders", "-q", "-p", "no:cacheprovider",
                          "-rs"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_adapters_cover_the_exercises():
    """Every exercise region in an export cell is listed in adapters.EXERCISES, and every target exists."""
    import adapters

    graded = set()
    for nb_path in NOTEBOOKS:
        for cell in nbformat.read(nb_path, as_version=4).cells:
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("solution") and cell.source.startswith(course.EXPORT_MARK):
                graded.add(meta["grade_id"])
    assert graded == set(adapters.EXERCISES), f"adapters.EXERCISES out of date: {graded ^ set(adapters.EXERCISES)}"
    for targets in adapters.EXERCISES.values():
        for t in targets:
            assert callable(adapters.resolve(t)), t


@pytest.mark.xdist_group("roundtrip")
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_release_roundtrip(roundtrip):
    rt, work = roundtrip
    print(rt.reference.summary(), rt.untouched.summary(), rt.seconds, sep="\n")
    assert not rt.problems(), "\n".join(rt.problems())
    assert set(rt.reference.notebooks) == {p.stem for p in NOTEBOOKS}
    # the stub package: an exercised function raises NotImplementedError, not anything else
    code = ("from minisgl.kvcache.pool import PageAllocator\n"
            "try:\n    PageAllocator(4).alloc(1)\nexcept NotImplementedError:\n    print('stub')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=work / "release-untouched",
                         env=dict(os.environ, PYTHONPATH=str(work / "release-untouched")), capture_output=True,
                         text=True)
    assert out.stdout.strip() == "stub", out.stdout + out.stderr
    # the instructor's output: grading ran from a python whose bin/ was off PATH (nbgrader runs `alembic`),
    # and wrote neither SQLAlchemy's autoflush warnings nor a kernel's TCP warning per notebook
    for student in ("reference", "untouched"):
        log = (work / f"autograde-{student}.log").read_text()
        for noise in ("SAWarning", "without encryption", "Traceback"):
            assert noise not in log, f"{noise!r} in {student}'s autograde output:\n{log[-2000:]}"


@pytest.mark.xdist_group("roundtrip")
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_feedback_embeds_plotly(roundtrip):
    """The feedback pages open offline: every plotly figure of a graded notebook is drawn by plotly.js embedded
    in its page, nothing is loaded from plotly's CDN."""
    rt, _ = roundtrip
    pages = 0
    for grades in (rt.reference, rt.untouched):
        for html in sorted(grades.feedback.glob("*.html")):
            text = html.read_text()
            figures = text.count("Plotly.newPlot(")
            assert not CDN_PLOTLY.search(text), f"{html.name} loads plotly from the CDN"
            if figures:
                pages += 1
                assert text.count("plotly.js v") >= 1 and len(text) > 3_000_000, \
                    f"{html.name}: {figures} figure(s) but no embedded plotly.js"
    assert pages >= 5, "the reference feedback has figures in most notebooks"


@pytest.mark.xdist_group("roundtrip")
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_release_speaks_to_students(roundtrip):
    """The release's README, pytest and JupyterLab settings are the students' (autograder/student/): `pytest` in
    the untouched release reports per notebook what is still a stub, with nothing failing; the walked release
    (every notebook done and exported) has no stub left."""
    import progress

    rt, work = roundtrip
    release = work / "release-untouched"
    readme = (release / "README.md").read_text()
    assert readme == (REPO / "autograder" / "student" / "README.md").read_text()
    assert "tests/" not in readme and "jupyter_lab_config.py" in readme
    assert (release / "jupyter_lab_config.py").exists() and not (release / "autograder" / "student").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"], cwd=release, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "failed" not in out.stdout.split("your progress")[0].lower(), out.stdout[-4000:]
    report = out.stdout.split("your progress, notebook by notebook")[-1]
    owners = set(course.module_owners().values())
    for nb in NOTEBOOKS:
        line = next((ln for ln in report.splitlines() if ln.strip().startswith(nb.stem)), "")
        want = "still the stub" if nb.name in owners else "no package exercise"
        assert want in line, f"{nb.stem}: {line!r}\n{report}"
    assert "0 failed" in report and "waiting for" in report
    assert progress.package_stubs(work / "release") == {nb.stem: {} for nb in NOTEBOOKS if nb.name in owners}


def test_tour_recording_is_current():
    """assets/tour_trace.json was recorded from this tour on this model (else: python -m lab.course.record_tour)."""
    out = subprocess.run([sys.executable, "-m", "lab.course.record_tour", "--check"], cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.xdist_group("roundtrip")
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_run_all_untouched(nb, roundtrip):
    """Run All on notebook NN as released, with 00..NN-1 done and exported (the release gate's run of it, in a
    real kernel): it may stop only in an exercise or graded cell of its own, on the stub; 00 runs to its end.
    The gate runs with errors allowed; Run All (stop at the first error) runs the same cells up to the first
    error, so that error is where Run All stops."""
    import gate

    rt, _ = roundtrip
    run = rt.gate.stubbed[nb.name]
    bad = gate.run_all_problems(run, rt.gate.owners)
    assert not bad, "\n".join(bad)
    if nb.name in gate.RUNS_TO_THE_END:
        assert not run.errors and not run.timed_out, [str(e) for e in run.errors]
        assert set(run.graded) <= run.failed_graded(), "its graded cells must still score 0 (stderr), not pass"


class Kernel:
    """A kernel of this interpreter driven as JupyterLab drives it: each cell is sent with its cell id."""

    def __init__(self, cwd: Path, env: dict) -> None:
        import gate
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import KernelManager

        self.specs = gate.kernel_spec_dir()
        self.km = KernelManager(kernel_name="minisgl-course", transport="ipc",
                                ip=str(Path(self.specs) / "kernel"),
                                kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(self.specs / "kernels")]))
        self.km.start_kernel(cwd=str(cwd), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, cell_id: str) -> tuple[str, str | None]:
        """(stdout + stderr, "ename: evalue" or None) of one cell."""
        msg = self.kc.session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                                      "user_expressions": {}, "allow_stdin": False,
                                                      "stop_on_error": True}, metadata={"cellId": cell_id})
        self.kc.shell_channel.send(msg)
        text, error = "", None
        while True:
            out = self.kc.get_iopub_msg(timeout=300)
            if out["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
                continue
            kind, content = out["msg_type"], out["content"]
            if kind == "stream":
                text += content["text"]
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                return text, error

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
        shutil.rmtree(self.specs, ignore_errors=True)


@pytest.mark.filterwarnings("ignore")
def test_export_reaches_a_kernel_that_imported_the_stubs(release_copy):
    """In a kernel that imported notebook 02's stub package: an export that would drop an edit the student ran
    but did not save refuses and names the cell; once saved, it exports, and the next cell (names imported
    before the export, the package module, a fresh import) runs the new code."""
    import gate

    nb = release_copy / "notebooks" / "02_kv_pool.ipynb"
    gate.fill(nb, REPO / "notebooks" / nb.name)  # the student's solution, saved
    cells = nbformat.read(nb, as_version=4).cells
    alloc_cell = next(i for i, c in enumerate(cells)
                      if c.source.startswith("#| export") and "class PageAllocator" in c.source)
    env = {k: v for k, v in os.environ.items() if k not in ("MINISGL_COURSE_NO_EXPORT", "PYTHONPATH")}
    env["PYTHONPATH"] = str(release_copy)
    k = Kernel(release_copy / "notebooks", env)
    try:
        assert cells[1].source.startswith("import coursekit")
        k.run(cells[1].source, cells[1].id)
        out, err = k.run("import minisgl.kvcache as kv\nfrom minisgl.kvcache.pool import PageAllocator as Pkg\n"
                         "try:\n    Pkg(8).alloc(2)\nexcept NotImplementedError as e:\n    print('stub:', e)\n",
                         "probe-1")
        assert err is None and "stub: exercise: see the notebook 02_kv_pool.ipynb, exercise nb02-alloc" in out, out
        # the student edits the allocator's cell and runs it, but does not save: the export must not drop it
        unsaved = cells[alloc_cell].source + "\n# an edit that is not saved"
        k.run(unsaved, cells[alloc_cell].id)
        out, err = k.run('coursekit.export_this("02_kv_pool")', cells[-1].id)
        assert err is not None and "nothing exported" in err and f"cell {alloc_cell}" in err and "Ctrl+S" in err, \
            (out, err)
        assert "raise NotImplementedError" in (release_copy / "minisgl" / "kvcache" / "pool.py").read_text()
        # saved (and run as saved): the export writes the package and reloads what the kernel imported
        k.run(cells[alloc_cell].source, cells[alloc_cell].id)
        out, err = k.run('coursekit.export_this("02_kv_pool")', cells[-1].id)
        assert err is None and "minisgl.kvcache.pool" in out and "Pkg" in out, out
        print(out)
        out, err = k.run("from minisgl.kvcache.pool import PageAllocator as Fresh\n"
                         "print(Pkg(8).alloc(2), kv.PageAllocator(8).alloc(2), Fresh(8).alloc(2), Pkg is Fresh)",
                         "probe-2")
        assert err is None, err
        assert out.split()[-1] == "True" and out.count("[") == 3, out
    finally:
        k.close()


def test_tour_lists_every_notebook():
    """The tour's course table has a row for every notebook after it (a new notebook adds its row)."""
    tour = nbformat.read(REPO / "notebooks" / "00_tour.ipynb", as_version=4)
    table = next(c.source for c in tour.cells if c.cell_type == "markdown" and "| notebook |" in c.source)
    rows = {line.split("|")[1].split()[0] for line in table.splitlines() if line.startswith("| ") and "---" not in line}
    missing = [nb.name for nb in NOTEBOOKS if nb.name[:2] != "00" and nb.name[:2] not in rows]
    assert not missing, f"00_tour.ipynb's course table has no row for {missing}"

