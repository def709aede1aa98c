# nbgrader configuration for the minisgl course.
#
# `autograder/course.py` stages a course directory (in a temp dir, or autograder/ when asked) laid out the way
# nbgrader expects, copies this file into it and runs nbgrader there:
#
#   <course>/source/course/NN_topic.ipynb, coursekit.py   the notebooks (assignment id "course")
#   <course>/release/course/...                            nbgrader generate_assignment
#   <course>/submitted/<student>/course/...                a submission
#   <course>/autograded/<student>/course/...               nbgrader autograde
#   <course>/feedback/<student>/course/*.html              nbgrader generate_feedback (hidden tests scrubbed)
#   <course>/gradebook.db
import atexit
import re
import shutil
import tempfile
from pathlib import Path

from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor, Preprocessor
from nbgrader.preprocessors import GetGrades
from traitlets import Bool

c = get_config()  # noqa: F821 (provided by traitlets when nbgrader loads this file)

c.CourseDirectory.course_id = "minisgl"
# the assignment id ("course") is passed on the command line by course.py

# What a student sees in place of a solution region, at the indentation of `### BEGIN SOLUTION`.
c.ClearSolutions.code_stub = {"python": '# YOUR CODE HERE\nraise NotImplementedError("exercise: see the notebook")'}

# Autograding runs whole notebooks (a tiny model, some plots): allow minutes per cell, not nbgrader's 30 s.
c.Execute.timeout = 300  # the release gate's limit too (gate.walk)
c.Execute.startup_timeout = 120
# A graded notebook's kernel is killed once its last cell ran, not asked to shut down: ipykernel 7.4 races its own
# shutdown (the control channel's "idle" status is sent through an event pipe the IO thread has closed) and now
# and then prints a ZMQError traceback into the instructor's log. Nothing is lost: the outputs are in, and the
# engine's child processes (a server's engine, TP ranks) exit when they see their parent gone.
c.Execute.shutdown_kernel = "immediate"

# Kernels talk over IPC sockets in a folder of this process, not TCP: no "Kernel is running over TCP without
# encryption" warning per notebook, and no port race between two autogrades running at once.
_SOCKETS = tempfile.mkdtemp(prefix="minisgl-nbgrader-ipc-")
atexit.register(shutil.rmtree, _SOCKETS, True)
c.KernelManager.transport = "ipc"
c.KernelManager.ip = str(Path(_SOCKETS) / "kernel")


_HIDDEN = re.compile(r"^[ \t]*### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS[ \t]*\n?", re.S | re.M)


class ScrubHiddenTests(Preprocessor):
    """Feedback never shows hidden tests: their source is cut from graded cells, and an error in a graded
    cell keeps only its last line (`AssertionError: message`), since a traceback quotes the failing line."""

    enabled = Bool(True)  # nbconvert preprocessors are off unless enabled

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade"):
            cell.source = _HIDDEN.sub("", cell.source)
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    out["traceback"] = [f"{out.get('ename', 'Error')}: {out.get('evalue', '')}"]
        return cell, resources


PLOTLY_MIME = "application/vnd.plotly.v1+json"


class EmbedPlotly(Preprocessor):
    """Feedback opens offline: every plotly figure is drawn from its JSON by plotly.js embedded in the page
    (once, with the first figure), not loaded from a CDN as the notebook's renderer does it."""

    enabled = Bool(True)

    def preprocess(self, nb, resources):
        import plotly.io as pio

        first = True
        for cell in nb.cells:
            for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
                data = out.get("data", {})
                if PLOTLY_MIME in data:
                    fig = dict(data[PLOTLY_MIME])
                    config = fig.pop("config", None)
                    data["text/html"] = pio.to_html(fig, config=config, include_plotlyjs=first, full_html=False,
                                                    include_mathjax=False, validate=False)
                    first = False
                elif "cdn.plot.ly" in data.get("text/html", ""):  # the renderer's loader of plotly.js
                    data["text/html"] = ""
        return nb, resources


c.GenerateFeedback.preprocessors = [GetGrades, ScrubHiddenTests, EmbedPlotly, CSSHTMLHeaderPreprocessor]
