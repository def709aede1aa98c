#!/usr/bin/env python
"""Course tooling: the notebooks are the source of the modules they teach (notebooks/CONVENTIONS.md).

    python autograder/course.py export [NB ...]   write minisgl/*.py from the notebooks' `#| export` cells
    python autograder/course.py check             exit 1 with a diff when a module differs from its notebook
    python autograder/course.py clean [NB ...]    strip outputs and execution counts from notebooks
    python autograder/course.py release OUT       the student release in OUT: nbgrader notebooks + stub package
    python autograder/course.py autograde NB_DIR  grade a folder of (submitted) notebooks, print the scores
    python autograder/course.py roundtrip         release; walk it as a student (autograder/gate.py: notebook k
                                                  fails only on its own stubs, runs clean once filled); grade the
                                                  walked notebooks (full marks) and the untouched release (zero);
                                                  check nothing leaks; exit 1 on any failure

`release`, `autograde` and `roundtrip` stage an nbgrader course directory in a temp dir (`--work DIR` keeps it).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

sys.modules.setdefault("rfc3987_syntax", None)  # an unused IRI checker of jsonschema's: ~1 s of import (coursekit.py)
import nbformat  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
ASSIGNMENT = "course"  # the nbgrader assignment id: the whole course is one assignment
EXPORT_MARK = "#| export "
HEADER = "# generated from notebooks/{nb} by autograder/course.py export — edit the notebook, not this file\n"
SOLUTION_LINES = ("### BEGIN SOLUTION", "### END SOLUTION")
STUB = 'raise NotImplementedError("exercise: see the notebook")'  # keep in sync with nbgrader_config.py
STUB_PREFIX = 'raise NotImplementedError("exercise: see the notebook'  # a stub in the package goes on (stub_for)
# What a release holds besides the notebooks (paths relative to the repository; directories recursively):
# the package, the embedded model, the graders, and the measured reports the GPU notebooks show on a CPU.
RELEASE_PATHS = ["pyproject.toml", "environment.yml", "assets", "minisgl", "autograder", "reports"]
RELEASE_SKIP = re.compile(r"(^|/)(__pycache__|\.ipynb_checkpoints)(/|$)|\.pyc$|"
                          r"^autograder/(release|submitted|autograded|feedback|source|student)(/|$)|"
                          r"^autograder/gradebook\.db$|"
                          r"^reports/.*\.log$")  # run logs quote source lines in their tracebacks
# Files of the release's root written for students (autograder/student/): their README (the repository's speaks
# to instructors), a pytest.ini that reports progress (autograder/progress.py) and JupyterLab's settings.
STUDENT_FILES = ["README.md", "pytest.ini", "jupyter_lab_config.py"]


# --- export / check / clean -------------------------------------------------------------------------------

def notebook_paths(nb_dir: Path = NOTEBOOKS, names=None) -> list[Path]:
    """The course notebooks `NN_topic.ipynb` in order, or the ones named (`02_kv_pool` or `02_kv_pool.ipynb`)."""
    paths = sorted(p for p in Path(nb_dir).glob("[0-9][0-9]_*.ipynb"))
    if names:
        want = {n if n.endswith(".ipynb") else n + ".ipynb" for n in (Path(n).name for n in names)}
        missing = want - {p.name for p in paths}
        if missing:
            raise SystemExit(f"no such notebook in {nb_dir}: {sorted(missing)}")
        paths = [p for p in paths if p.name in want]
    return paths


def export_cells(nb_path: Path) -> dict[str, list[tuple[str, str]]]:
    """module path -> (cell marker, source) of its export cells, in order, export line removed. An exercise
    stub in a cell (a release, or an exercise not done yet) names its notebook and exercise (`stub_for`)."""
    nb = nbformat.read(nb_path, as_version=4)
    cells: dict[str, list[tuple[str, str]]] = {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.startswith(EXPORT_MARK):
            continue
        first, _, rest = cell.source.partition("\n")
        module = first[len(EXPORT_MARK):].strip()
        if not re.fullmatch(r"minisgl/[\w/]+\.py", module):
            raise ValueError(f"{nb_path.name}: bad export target {module!r}")
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id", f"cell {index}")
        rest = "\n".join(ln[:len(ln) - len(ln.lstrip())] + stub_for(nb_path.name, grade_id) if ln.strip() == STUB
                         else ln for ln in rest.split("\n"))
        cells.setdefault(module, []).append((cell_marker(nb_path.name, index, cell.get("id")), rest))
    return cells


def stub_for(nb_name: str, grade_id: str) -> str:
    """The stub line as the package holds it: a later notebook that reaches it says where to go. Its message
    begins as the notebook's own stub's does (gate.STUB_ERROR)."""
    return (f'raise NotImplementedError("exercise: see the notebook {nb_name}, exercise {grade_id}: solve it '
            f'there and run that notebook\'s export cell (its last cell)")')


def cell_marker(nb_name: str, index: int, cell_id: str | None) -> str:
    """The comment that opens each exported cell in a generated module, so a traceback leads to its cell:
    the notebook, the cell's position (0-based, as in the .ipynb's list of cells) and its id."""
    where = f"cell {index}" + (f" (id {cell_id})" if cell_id else "")
    return f"# --- notebooks/{nb_name}, {where} ---"


def render_module(nb_name: str, cells: list[tuple[str, str]]) -> str:
    """Header + cells (solution marker lines dropped), each opened by its cell marker, two blank lines between
    cells, one final newline."""
    parts = []
    for marker, src in cells:
        lines = [ln for ln in src.split("\n") if ln.strip() not in SOLUTION_LINES]
        parts.append(marker + "\n" + "\n".join(lines).lstrip("\n").rstrip())
    return HEADER.format(nb=nb_name) + "\n\n\n".join(parts) + "\n"


def generate(nb_dir: Path = NOTEBOOKS, names=None) -> dict[str, str]:
    """module path (relative to the package root) -> generated text, for the given notebooks."""
    out: dict[str, str] = {}
    owner: dict[str, str] = {}
    for nb in notebook_paths(nb_dir, names):
        for module, sources in export_cells(nb).items():
            if module in owner:
                raise ValueError(f"{module} is exported by both {owner[module]} and {nb.name}")
            owner[module] = nb.name
            out[module] = render_module(nb.name, sources)
    return out


def export(nb_dir: Path = NOTEBOOKS, dest: Path = REPO, names=None, quiet: bool = False) -> list[str]:
    """Write the generated modules under `dest`; only files whose text changes are touched."""
    changed = []
    for module, text in generate(nb_dir, names).items():
        path = Path(dest) / module
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(module)
    if not quiet:
        n = len(generate(nb_dir, names))
        print(f"exported {n} module(s); {len(changed)} changed" + "".join(f"\n  {m}" for m in changed))
    return changed


def check(nb_dir: Path = NOTEBOOKS, dest: Path = REPO) -> list[str]:
    """Unified diffs (committed -> generated) for every module that differs from its notebook."""
    diffs = []
    for module, text in generate(nb_dir).items():
        path = Path(dest) / module
        old = path.read_text() if path.exists() else ""
        if old != text:
            diffs.append("".join(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                      f"{module} (committed)", f"{module} (from notebook)")))
    return diffs


def clean(paths) -> list[Path]:
    """Strip outputs, execution counts and per-run metadata; returns the notebooks that changed."""
    changed = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        before = nbformat.writes(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
            for key in ("execution", "collapsed", "scrolled", "ExecuteTime"):
                cell.metadata.pop(key, None)
        nb.metadata.pop("widgets", None)
        if nbformat.writes(nb) != before:
            nbformat.write(nb, path)
            changed.append(path)
    return changed


# --- release ----------------------------------------------------------------------------------------------

def _run(cmd, cwd, env=None, log=None) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if log is not None:
        log.write(f"$ {' '.join(map(str, cmd))}  (in {cwd})\n{out.stdout}{out.stderr}\n")
    if out.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


def _nbgrader(step: str, course: Path, student: str | None = None, env=None, log=None) -> None:
    """Run one nbgrader step in this process (importing nbgrader costs ~10 s; a subprocess per step would pay
    it each time) with the course's nbgrader_config.py. `env` is set while it runs (kernels inherit it)."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    cfg.CourseDirectory.root = str(course)
    api = NbGraderAPI(config=cfg)
    # nbgrader runs `alembic` from PATH: a virtual environment's python run without activating it has that
    # environment's bin/ off PATH, so put it first
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]), **(env or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with warnings.catch_warnings():
            # nbgrader's gradebook adds objects SQLAlchemy's autoflush warns about; the grades are unaffected
            warnings.filterwarnings("ignore", message=".*not in session.*")
            if step == "generate_assignment":
                res = api.generate_assignment(ASSIGNMENT, force=True)
            else:
                res = getattr(api, step)(ASSIGNMENT, student, force=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if log is not None:
        log.write(f"--- nbgrader {step} {student or ''}\n{res.get('log', '')}\n")
    if not res["success"]:
        raise RuntimeError(f"nbgrader {step} failed:\n{res.get('log', '')}\n{res.get('error', '')}")


def _repo_files() -> list[str]:
    """Files of the repository (tracked or not ignored), relative paths."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode:  # not a git checkout (e.g. an unpacked archive): walk the tree
        return [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()]
    return out.stdout.splitlines()


def stage_course(work: Path, nb_dir: Path = NOTEBOOKS) -> Path:
    """An nbgrader course directory under work/ with the source notebooks and our config."""
    course = Path(work) / "nbgrader"
    if course.exists():
        shutil.rmtree(course)
    src = course / "source" / ASSIGNMENT
    src.mkdir(parents=True)
    for nb in notebook_paths(nb_dir):
        shutil.copy2(nb, src / nb.name)
    shutil.copy2(Path(nb_dir) / "coursekit.py", src / "coursekit.py")
    shutil.copy2(REPO / "autograder" / "nbgrader_config.py", course / "nbgrader_config.py")
    return course


def release(out: Path, work: Path, log=None) -> Path:
    """Build the student release in `out`; returns the staged nbgrader course directory (under `work`).

    out/notebooks/  nbgrader generate_assignment: solutions replaced by stubs, hidden tests removed
    out/minisgl/    the package: plain modules copied, generated modules exported from the *released*
                    notebooks, so every exercise is a stub that raises NotImplementedError
    out/...         pyproject, assets, autograder (the graders; never the source notebooks), reports
    out/README.md, pytest.ini, jupyter_lab_config.py   for students (autograder/student/)
    """
    out, work = Path(out), Path(work)
    course = stage_course(work)
    _nbgrader("generate_assignment", course, log=log)
    if out.exists():
        shutil.rmtree(out)
    for rel in _repo_files():
        if not any(rel == p or rel.startswith(p + "/") for p in RELEASE_PATHS) or RELEASE_SKIP.search(rel):
            continue
        src = REPO / rel
        if src.is_file():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out / rel)
    for name in STUDENT_FILES:
        shutil.copy2(REPO / "autograder" / "student" / name, out / name)
    shutil.copytree(course / "release" / ASSIGNMENT, out / "notebooks")
    ref_modules = set(generate(NOTEBOOKS))
    rel_modules = set(generate(out / "notebooks"))
    if ref_modules != rel_modules:
        raise RuntimeError(f"release notebooks export other modules: {sorted(ref_modules ^ rel_modules)}")
    export(out / "notebooks", out, quiet=True)
    return course


# --- autograde --------------------------------------------------------------------------------------------

@dataclass
class Grades:
    student: str
    score: float
    max_score: float
    notebooks: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (score, max)
    cells: dict[str, tuple[float, float]] = field(default_factory=dict)  # "nb/grade_id" -> (score, max)
    feedback: Path | None = None

    def summary(self) -> str:
        lines = [f"{self.student}: {self.score:g} / {self.max_score:g}"]
        lines += [f"  {nb}: {s:g} / {m:g}" for nb, (s, m) in self.notebooks.items()]
        return "\n".join(lines)


def package_for(submission: Path, base: Path, dest: Path) -> Path:
    """A release-like root for grading `submission`: base's package with the submission's modules exported in,
    and links to the rest of the release (assets, README, ...) so notebooks find what they read there."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(base / "minisgl", dest / "minisgl", ignore=shutil.ignore_patterns("__pycache__"))
    for entry in base.iterdir():  # the rest of the release (assets, README, autograder, ...) as links
        if entry.name not in ("minisgl", "notebooks"):
            os.symlink(entry.resolve(), dest / entry.name)
    export(submission, dest, quiet=True)
    return dest


def autograde(course: Path, student: str, submission: Path, base: Path, work: Path, log=None) -> Grades:
    """Autograde the notebooks in `submission` as `student` in the staged course (after `release`).

    The notebooks import the package built from the submission itself (`package_for`), so a later notebook
    is graded against the student's own earlier modules. Feedback HTML has hidden tests scrubbed.
    """
    from nbgrader.api import Gradebook

    sub = course / "submitted" / student / ASSIGNMENT
    if sub.exists():
        shutil.rmtree(sub)
    sub.mkdir(parents=True)
    for nb in notebook_paths(submission):
        shutil.copy2(nb, sub / nb.name)
    shutil.copy2(Path(submission) / "coursekit.py", sub / "coursekit.py")
    pkg = package_for(submission, base, Path(work) / f"package-{student}")
    path = os.pathsep.join(x for x in (str(pkg), os.environ.get("PYTHONPATH")) if x)
    env = {"PYTHONPATH": path, "MINISGL_COURSE_NO_EXPORT": "1"}
    _nbgrader("autograde", course, student, env=env, log=log)
    _nbgrader("generate_feedback", course, student, log=log)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        s = gb.find_submission(ASSIGNMENT, student)
        grades = Grades(student, s.score, s.max_score, feedback=course / "feedback" / student / ASSIGNMENT)
        for nb in s.notebooks:
            grades.notebooks[nb.name] = (nb.score, nb.max_score)
            for g in nb.grades:
                grades.cells[f"{nb.name}/{g.name}"] = (g.score, g.max_score)
    return grades


# --- checks on a release ----------------------------------------------------------------------------------

def _regions(text: str, begin: str, end: str) -> list[str]:
    return re.findall(rf"^[ \t]*### {begin}[^\n]*\n(.*?)^[ \t]*### {end}", text, re.S | re.M)


def _stripped(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def secret_lines(nb_dir: Path = NOTEBOOKS, kinds=("SOLUTION", "HIDDEN TESTS"), long_line: int = 40) -> set[str]:
    """Fingerprints of the solutions and/or hidden tests, i.e. text a release must not contain: every line of
    those regions of at least `long_line` characters, and every pair of consecutive lines (joined by a newline),
    leaving out lines that also appear outside the regions in the source notebooks (those are public anyway).
    Pairs rather than short single lines: `for _ in range(40):` alone is no solution and shows up anywhere."""
    secret, public = set(), set()
    for nb_path in notebook_paths(nb_dir):
        for cell in nbformat.read(nb_path, as_version=4).cells:
            src = cell.source
            for kind in kinds:
                for region in _regions(src, f"BEGIN {kind}", f"END {kind}"):
                    lines = _stripped(region)
                    secret.update(ln for ln in lines if len(ln) >= long_line)
                    secret.update(f"{x}\n{y}" for x, y in zip(lines, lines[1:]) if len(x) + len(y) >= 24)
            rest = re.sub(r"### BEGIN (SOLUTION|HIDDEN TESTS).*?### END (SOLUTION|HIDDEN TESTS)", "", src,
                          flags=re.S)
            public.update(_stripped(rest))
    return {s for s in secret if not all(part in public for part in s.split("\n"))}


def find_leaks(release_dir: Path, secrets: set[str]) -> list[str]:
    """`file: fingerprint` for every secret fingerprint found in any text file under `release_dir`."""
    leaks = []
    for path in sorted(Path(release_dir).rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if path.suffix == ".ipynb":  # compare cell by cell, not the JSON-escaped file
            text = "\n".join(c.source for c in nbformat.reads(text, as_version=4).cells)
        elif path.suffix == ".html":  # feedback: compare the text, not the markup
            import html

            text = html.unescape(re.sub(r"<[^>]+>", "", text))
        lines = _stripped(text)
        have = set(lines) | {f"{x}\n{y}" for x, y in zip(lines, lines[1:])}
        leaks += [f"{path.relative_to(release_dir)}: {s!r}" for s in sorted(secrets & have)]
    return leaks


def passing_graded_cells(nb_dir: Path) -> list[str]:
    """nbgrader's Validator(invert=True) over already executed notebooks: graded cells that pass."""
    from nbgrader.validator import Validator

    passed = []
    for nb in notebook_paths(nb_dir):
        res = Validator(invert=True, preprocessors=[], ignore_checksums=True).validate(str(nb))
        passed += [f"{nb.name}: {c['source'].splitlines()[0]}" for c in res.get("passed", [])]
    return passed


def cell_errors(nb_dir: Path) -> list[str]:
    """`notebook: cell n: Error` for every code cell with an error output in executed notebooks (autograde runs
    every cell, so for the reference solution this is nbval's check once more)."""
    errors = []
    for nb in notebook_paths(nb_dir):
        for i, cell in enumerate(nbformat.read(nb, as_version=4).cells):
            for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
                if out.get("output_type") == "error":
                    errors.append(f"{nb.name}: cell {i}: {out.get('ename')}: {out.get('evalue', '')[:200]}")
    return errors


def import_check(release_dir: Path) -> None:
    """The release package imports, module by module, and nothing runs an exercise at import time."""
    modules = sorted({m[:-3].replace("/", ".").removesuffix(".__init__") for m in generate(release_dir / "notebooks")})
    code = "import importlib, minisgl\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += f"print('ok', {len(modules)})"
    env = dict(os.environ, PYTHONPATH=str(release_dir))
    out = _run([sys.executable, "-c", code], cwd=release_dir, env=env)
    if not out.stdout.strip().startswith("ok"):
        raise RuntimeError(f"the release package does not import:\n{out.stdout}{out.stderr}")


@dataclass
class RoundTrip:
    reference: Grades  # the gate's filled notebooks (reference solutions typed into the release), autograded
    untouched: Grades
    leaks: list[str]
    passing_on_stubs: list[str]
    feedback_leaks: list[str]
    reference_errors: list[str]
    stubs_in_package: int
    seconds: dict[str, float]
    gate: object = None  # gate.Gate: the progressive walk over the release

    def problems(self) -> list[str]:
        bad = []
        if self.reference.max_score <= 0:
            bad.append("no graded cells at all")
        for name, (s, m) in self.reference.cells.items():
            if s != m:
                bad.append(f"reference solution loses points: {name} {s:g}/{m:g}")
        for name, (s, m) in self.untouched.cells.items():
            if s != 0:
                bad.append(f"untouched release scores: {name} {s:g}/{m:g}")
        bad += [f"solution text in the release: {x}" for x in self.leaks]
        bad += [f"graded cell passes on the stubs: {x}" for x in self.passing_on_stubs]
        bad += [f"hidden test text in feedback: {x}" for x in self.feedback_leaks]
        bad += [f"the reference raised under autograde: {x}" for x in self.reference_errors]
        if self.stubs_in_package == 0:
            bad.append("the release package has no exercise stubs")
        if self.gate is not None:
            bad += [f"release gate: {x}" for x in self.gate.problems()]
        return bad


def autograde_in_subprocess(course: Path, student: str, submission: Path, base: Path, work: Path,
                            env: dict | None = None) -> Grades:
    """`autograde` in a child process (so two can run at once: each has its own course copy and PYTHONPATH);
    its stderr goes to work/autograde-STUDENT.log."""
    out = _run([sys.executable, str(Path(__file__).resolve()), "grade-staged", str(course), str(submission),
                "--student", student, "--base", str(base), "--work", str(work)], cwd=REPO, env=env)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    with open(Path(work) / f"autograde-{student}.log", "w") as f:
        f.write(out.stderr)
    return Grades(student, data["score"], data["max_score"], {k: tuple(v) for k, v in data["notebooks"].items()},
                  {k: tuple(v) for k, v in data["cells"].items()}, Path(data["feedback"]))


def module_owners(nb_dir: Path = NOTEBOOKS) -> dict[str, str]:
    """Generated module (minisgl/...) -> the notebook file that exports it."""
    return {module: nb.name for nb in notebook_paths(nb_dir) for module in export_cells(nb)}


def roundtrip(work: Path, log=None, timeout: int = 300) -> RoundTrip:
    """The release checked as a student walks it, in one release:

    - release; no solution or hidden-test text in it; its package imports with every exercise a stub;
    - the untouched release is autograded (zero on every graded cell; feedback without hidden tests), and
      the release's notebooks filled with the reference solutions (as a student typed them) too (full marks
      on every graded cell, no cell raising, feedback without hidden tests), each in a child process on a
      snapshot, while
    - the release gate walks the release (`gate.walk`): notebook k with 0..k-1 filled and exported fails only
      with its own exercise's stub (and Run All stops only there); filled, it runs clean and exports.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gate as release_gate

    work = Path(work)
    t = {"start": time.perf_counter()}
    out = work / "release"
    course = release(out, work, log=log)
    t["release"] = time.perf_counter()
    secrets = secret_lines()
    leaks = find_leaks(out, secrets)
    import_check(out)
    stubs = sum(text.count(STUB_PREFIX) for text in generate(out / "notebooks").values())
    untouched = work / "release-untouched"  # the gate changes `out`; the untouched grade needs it as released
    if untouched.exists():
        shutil.rmtree(untouched)
    shutil.copytree(out, untouched, symlinks=True)
    courses = {}
    for student in ("reference", "untouched"):  # one course copy each: sqlite gradebooks are not for two writers
        courses[student] = work / f"nbgrader-{student}"
        if courses[student].exists():
            shutil.rmtree(courses[student])
        shutil.copytree(course, courses[student])
    # The reference grade needs the notebooks as a student who finished them typed them: the release's,
    # filled with the reference solutions (what the gate fills them with, in `out`, as it walks). A copy filled
    # up front lets both autogrades run beside the walk instead of after it.
    reference = work / "release-reference-notebooks"
    if reference.exists():
        shutil.rmtree(reference)
    shutil.copytree(out / "notebooks", reference)
    for nb in notebook_paths(reference):
        release_gate.fill(nb, NOTEBOOKS / nb.name)
    from concurrent.futures import ThreadPoolExecutor

    # graded as from a virtual environment's python that is not activated: no `alembic` on PATH (nbgrader runs it)
    env = dict(os.environ, PATH=os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                                 if p and not (Path(p) / "alembic").exists()))
    with ThreadPoolExecutor(2) as pool:
        pending = {"untouched": pool.submit(autograde_in_subprocess, courses["untouched"], "untouched",
                                            untouched / "notebooks", untouched, work, env),
                   "reference": pool.submit(autograde_in_subprocess, courses["reference"], "reference", reference,
                                            untouched, work, env)}
        walked = release_gate.walk(out, NOTEBOOKS, notebook_paths(out / "notebooks"), module_owners(), timeout, log)
        t["gate"] = time.perf_counter()
        grades = {student: job.result() for student, job in pending.items()}
    t["autograde"] = time.perf_counter()
    passing = passing_graded_cells(courses["untouched"] / "autograded" / "untouched" / ASSIGNMENT)
    hidden = secret_lines(kinds=("HIDDEN TESTS",))
    fb_leaks = []
    for g in grades.values():
        fb_leaks += find_leaks(g.feedback, hidden)
    keys = list(t)
    secs = {k: round(t[k] - t[keys[i - 1]], 1) for i, k in enumerate(keys) if i}
    ref_errors = cell_errors(courses["reference"] / "autograded" / "reference" / ASSIGNMENT)
    return RoundTrip(grades["reference"], grades["untouched"], leaks, passing, fb_leaks, ref_errors, stubs, secs,
                     walked)


# --- CLI --------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("export")
    p.add_argument("notebooks", nargs="*")
    sub.add_parser("check")
    p = sub.add_parser("clean")
    p.add_argument("notebooks", nargs="*")
    p = sub.add_parser("release")
    p.add_argument("out")
    p.add_argument("--work")
    p = sub.add_parser("autograde")
    p.add_argument("submission", help="folder with the NN_*.ipynb to grade (and coursekit.py)")
    p.add_argument("--student", default="student")
    p.add_argument("--work")
    p.add_argument("--feedback", help="where the feedback pages go (default: feedback-STUDENT in this folder)")
    p = sub.add_parser("grade-staged", help="(internal) autograde in an already released, staged course")
    p.add_argument("course")
    p.add_argument("submission")
    p.add_argument("--student", required=True)
    p.add_argument("--base", required=True, help="the release folder (its package and assets)")
    p.add_argument("--work", required=True)
    p = sub.add_parser("roundtrip")
    p.add_argument("--work", help="keep the staged course, release and packages here")
    args = ap.parse_args(argv)

    if args.cmd == "export":
        export(names=args.notebooks or None)
        return 0
    if args.cmd == "check":
        diffs = check()
        for d in diffs:
            print(d)
        print(f"check: {len(generate())} generated module(s), {len(diffs)} differ from their notebooks"
              + ("" if not diffs else " -- run `python autograder/course.py export` and commit"))
        return 1 if diffs else 0
    if args.cmd == "clean":
        for p in clean(notebook_paths(NOTEBOOKS, args.notebooks or None)):
            print(f"cleaned {p.name}")
        return 0

    if args.cmd == "grade-staged":
        with open(Path(args.work) / f"nbgrader-{args.student}.log", "w") as log:
            g = autograde(Path(args.course), args.student, Path(args.submission), Path(args.base), Path(args.work),
                          log=log)
        print(json.dumps({"score": g.score, "max_score": g.max_score, "notebooks": g.notebooks, "cells": g.cells,
                          "feedback": str(g.feedback)}))
        return 0

    with tempfile.TemporaryDirectory(prefix="minisgl-course-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.cmd == "release":
            release(Path(args.out).resolve(), work)
            import_check(Path(args.out).resolve())
            print(f"release written to {args.out}")
            return 0
        if args.cmd == "autograde":
            out = work / "release"
            course = release(out, work)
            g = autograde(course, args.student, Path(args.submission).resolve(), out, work)
            feedback = Path(args.feedback or f"feedback-{args.student}").resolve()
            if feedback.exists():
                shutil.rmtree(feedback)
            shutil.copytree(g.feedback, feedback)  # the staged course (unless --work) goes with the temp dir
            print(g.summary())
            print(f"feedback (one page per notebook, opens offline): {feedback}")
            return 0
        if args.cmd == "roundtrip":
            with open(work / "roundtrip.log", "w") as log:
                rt = roundtrip(work, log=log)
            print(rt.reference.summary())
            print(rt.untouched.summary())
            print(f"package stubs: {rt.stubs_in_package}; seconds: {json.dumps(rt.seconds)}")
            (work / "gate.json").write_text(json.dumps(rt.gate.as_json(), indent=1))
            print(f"release gate: {work / 'gate.json'}")
            bad = rt.problems()
            print("roundtrip: OK" if not bad else "roundtrip FAILED:\n  " + "\n  ".join(bad))
            return 1 if bad else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
