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
- `test_tour_recording_is_current`: assets/tour_trace.json matches the tour and the model.

All of it runs in `python -m pytest` (CI); `-m "not slow"` leaves out the slow parts while you edit.
"""

from __future__ import annotations

import importlib.util
import os
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


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_walk(nb, roundtrip):
    """The release gate for notebook NN: with 00..NN-1 done, it fails only on its own exercise's stubs (and
    every graded cell fails); with NN done too, every cell passes (within the 3-minute budget) and exports."""
    import gate

    rt, _ = roundtrip
    before, after = rt.gate.stubbed[nb.name], rt.gate.filled[nb.name]
    print(f"{nb.name}: {before.seconds:.0f} s before the exercises, {after.seconds:.0f} s with them")
    bad = gate.unexpected(before, rt.gate.owners)
    assert not bad, "errors a student who finished the earlier notebooks would hit:\n" + "\n".join(bad)
    failed = {e.kind.split(" ", 1)[1] for e in before.errors if e.kind.startswith("graded")}
    assert set(before.graded) <= failed, f"graded cells passing on the stubs: {set(before.graded) - failed}"
    assert not after.errors and not after.timed_out, \
        f"{nb.name} with the reference solution:\n" + "\n".join(map(str, after.errors)) + after.timed_out
    assert after.seconds < 180, f"{nb.name} took {after.seconds:.0f} s; the budget is 3 minutes on a 2-core CPU"


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


def test_tour_recording_is_current():
    """assets/tour_trace.json was recorded from this tour on this model (else: python -m lab.course.record_tour)."""
    out = subprocess.run([sys.executable, "-m", "lab.course.record_tour", "--check"], cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
