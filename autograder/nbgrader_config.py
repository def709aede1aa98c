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
import re

from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor, Preprocessor
from nbgrader.preprocessors import GetGrades
from traitlets import Bool

c = get_config()  # noqa: F821 (provided by traitlets when nbgrader loads this file)

c.CourseDirectory.course_id = "minisgl"
# the assignment id ("course") is passed on the command line by course.py

# What a student sees in place of a solution region, at the indentation of `### BEGIN SOLUTION`.
c.ClearSolutions.code_stub = {"python": '# YOUR CODE HERE\nraise NotImplementedError("exercise: see the notebook")'}

# Autograding runs whole notebooks (a tiny model, some plots): allow minutes per cell, not nbgrader's 30 s.
c.Execute.timeout = 600
c.Execute.startup_timeout = 120


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


c.GenerateFeedback.preprocessors = [GetGrades, ScrubHiddenTests, CSSHTMLHeaderPreprocessor]
