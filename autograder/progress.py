"""`python -m pytest` in the student release: the graders as a progress report (a pytest plugin).

The release's `pytest.ini` runs `autograder/graders/` with this plugin (`-p progress`). A check that reaches
an exercise still a stub is skipped, saying which notebook and exercise it waits for (the package's stubs
name them: `course.py stub_for`), instead of failing; a check that fails on code the student wrote fails as
usual. At the end, a table notebook by notebook: how many of its package exercises are still the stub, and
what the checks said. Exit status 0 means nothing written so far is wrong, not that the course is done.

Only the release loads it: in the repository and for an instructor, a stub is a failure like any other.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUB = re.compile(r'exercise: see the notebook (\d\d_\w+)\.ipynb, exercise ([\w-]+)')
GENERATED = re.compile(r"^# generated from notebooks/(\d\d_\w+)\.ipynb")

_waiting: dict[str, str] = {}  # test nodeid -> "NN_topic.ipynb (grade_id)" it waits for
_status: dict[str, str] = {}  # test nodeid -> passed / skipped / failed (the worst of its phases)
_RANK = {"passed": 0, "skipped": 1, "failed": 2}


def package_stubs(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """Notebook stem -> {exercise grade_id: stub lines left} over the package's generated modules; every
    notebook that generates a module is listed (an empty dict: no stub left)."""
    found: dict[str, dict[str, int]] = {}
    for path in sorted((root / "minisgl").rglob("*.py")):
        text = path.read_text()
        head = GENERATED.match(text)
        if head is None:
            continue
        found.setdefault(head.group(1), {})
        for nb, grade_id in STUB.findall(text):
            found.setdefault(nb, {})
            found[nb][grade_id] = found[nb].get(grade_id, 0) + 1
    return found


def exercises_of(notebook: str) -> set[str]:
    """The package exercises (grade_ids) of a notebook, from adapters.EXERCISES."""
    import adapters

    return {g for g in adapters.EXERCISES if g.startswith(f"nb{notebook[:2]}-")}


def _stub_in(excinfo) -> str | None:
    """`NN_topic.ipynb (grade_id)` when the exception (or one it came from) is an exercise stub's."""
    exc = excinfo.value if excinfo is not None else None
    while exc is not None:
        if isinstance(exc, NotImplementedError):
            m = STUB.search(str(exc))
            if m:
                return f"{m.group(1)}.ipynb ({m.group(2)})"
            if str(exc).startswith("exercise: see the notebook"):
                return "an exercise of a notebook"
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        waiting = _stub_in(call.excinfo)
        if waiting is not None:
            _waiting[item.nodeid] = waiting
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"waits for the exercise in {waiting}")
    if report.when == "call" or report.outcome != "passed":
        old = _status.get(item.nodeid, "passed")
        _status[item.nodeid] = max(old, report.outcome, key=_RANK.__getitem__)


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    stubs = package_stubs()
    tr.section("your progress, notebook by notebook")
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for nb in notebooks:
        if nb not in stubs:
            tr.write_line(f"  {nb:20} no package exercise: graded in the notebook (run its test cells)")
            continue
        total = len(exercises_of(nb)) or len(stubs[nb])
        left = len(stubs[nb])
        if left == 0:
            state = "done: every exercise is in the package"
        elif left >= total:
            state = f"still the stub: {left} exercise(s) to write, then run the notebook's last cell"
        else:
            state = f"in progress: {left} of {total} exercise(s) still the stub ({', '.join(sorted(stubs[nb]))})"
        tr.write_line(f"  {nb:20} {state}")
    counts = Counter(_status.values())
    waiting = Counter(_waiting.values())
    tr.write_line(f"checks: {counts['passed']} passed, {counts['failed']} failed, {len(_waiting)} waiting for an "
                  f"exercise, {counts['skipped'] - len(_waiting)} skipped for another reason (-rs says why)")
    for where, n in sorted(waiting.items()):
        tr.write_line(f"  {n:3} waiting for {where}")
