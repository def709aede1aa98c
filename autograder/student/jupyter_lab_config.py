# JupyterLab for the student release: `jupyter lab --config=jupyter_lab_config.py` from the release folder.
#
# nbgrader installs its instructor tools into every JupyterLab of the environment: the Nbgrader menu,
# Formgrader (which warns about an exchange directory this course does not use), Create Assignment on every
# notebook, and the exchange-based Assignment and Course lists. A student needs none of them: grading runs
# `autograder/course.py autograde` on the saved notebooks. Only nbgrader's Validate button stays.
c = get_config()  # noqa: F821 (provided by traitlets when JupyterLab loads this file)

INSTRUCTOR_PLUGINS = ["@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                      "@jupyter/nbgrader:assignment-list", "@jupyter/nbgrader:course-list",
                      "@jupyter/nbgrader:menu"]
c.ServerApp.jpserver_extensions = {"nbgrader.server_extensions.formgrader": False,
                                   "nbgrader.server_extensions.assignment_list": False,
                                   "nbgrader.server_extensions.course_list": False}


def hide_instructor_plugins(handler, page_config):
    """JupyterLab's page config hook: the front end never loads the instructor plugins."""
    disabled = list(page_config.get("disabledExtensions", []))
    page_config["disabledExtensions"] = disabled + [p for p in INSTRUCTOR_PLUGINS if p not in disabled]
    return page_config


c.ServerApp.tornado_settings = {"page_config_hook": hide_instructor_plugins}
