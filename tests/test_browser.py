"""The course in a real browser: JupyterLab serving a student release, driven by headless Chromium.

A student works in JupyterLab, where plotly figures and ipywidgets are drawn by JupyterLab extensions that
nbclient never loads: a figure saved as JSON can still fail to render, and a widget can stay at "Loading
widget...". This test takes a release, fills notebooks 00-07 with the reference solutions and exports them (a
student who has finished notebook 07), starts JupyterLab the way the release's README says
(`jupyter lab --config=jupyter_lab_config.py`, on 127.0.0.1 with a token), and in Debian's `/usr/bin/chromium`
driven by Playwright:

- checks that the student sees the student tools only: no Nbgrader menu, no Create Assignment sidebar (the
  instructor's nbgrader plugins), the Validate button still there;
- opens notebooks/04_radix_cache.ipynb, runs all cells from the Run menu: every code cell ran, the radix
  tree figures rendered, the stepper's widgets rendered and a click on its button runs in the kernel;
- opens notebooks/07_overlap.ipynb, runs all cells: every code cell ran and the kernel timeline rendered.

Screenshots of the tree, the stepper and the timeline go to $MINISGL_SCREENSHOT_DIR (else the test's temp
dir); the ones in reports/course/ were made so, once, to look at.

Needs: chromium (`apt-get install chromium`) and `playwright` (the dev extra; never `playwright install`: we
use the system browser). .ci/run installs chromium; without it the test skips and says why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import copy_release

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("MINISGL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DONE_UP_TO = "07_overlap"  # notebooks 00..07 filled with the reference and exported
# Run All has finished: no cell queued or running, and every code cell has an execution count (or a cell
# raised, which stops the run: the test then reports the error)
RUN_FINISHED = """() => {
    const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim());
    const raised = [...document.querySelectorAll('.jp-RenderedText')].some(e => e.textContent.includes('Traceback'));
    return prompts.length > 0 && !prompts.some(t => t.includes('*'))
        && (prompts.every(t => /\\[\\d+\\]/.test(t)) || raised);
}"""


def _why_not() -> str:
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    for mod in ("playwright", "jupyterlab", "nbgrader", "plotly", "ipywidgets"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install -e '.[dev,course]')"
    return ""


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "ok"),
              pytest.mark.xdist_group("browser")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def student_release(course_release, tmp_path_factory):
    """A release in which notebooks 00..07 hold the reference solutions and are exported."""
    import gate

    out = copy_release(course_release, tmp_path_factory.mktemp("browser") / "release")
    for nb in sorted((out / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        if nb.stem <= DONE_UP_TO:
            gate.fill(nb, REPO / "notebooks" / nb.name)
    subprocess.run([sys.executable, "autograder/course.py", "export"], cwd=out, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def jupyterlab(student_release, tmp_path_factory):
    """JupyterLab on 127.0.0.1 serving the release, with the release's settings; yields (base URL, token)."""
    tmp = tmp_path_factory.mktemp("lab")
    settings = tmp / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # render every cell (JupyterLab 4 leaves cells outside the viewport out of the page by default)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MINISGL_COURSE_NO_EXPORT")}
    env.update(PYTHONPATH=str(student_release), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
    log = open(tmp / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--config=jupyter_lab_config.py", "--no-browser", "--ip=127.0.0.1",
         f"--port={port}", "--ServerApp.port_retries=0", "--allow-root", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={student_release}", f"--LabApp.user_settings_dir={tmp / 'settings'}",
         f"--LabApp.workspaces_dir={tmp / 'workspaces'}"],
        cwd=student_release, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"JupyterLab did not start:\n{(tmp / 'jupyterlab.log').read_text()[-3000:]}")
        time.sleep(0.5)
    yield base, token
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def shots(tmp_path) -> Path:
    out = Path(os.environ.get("MINISGL_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _wait_for_idle_kernel(base: str, token: str, notebook: str, timeout: float = 120) -> None:
    """Until the notebook's kernel (started when the page opened it) reports idle, through the server's API."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=5) as r:
            sessions = json.load(r)
        if any(s["path"].endswith(f"{notebook}.ipynb") and s["kernel"]["execution_state"] == "idle" for s in sessions):
            return
        time.sleep(0.5)
    pytest.fail(f"the kernel of {notebook} never became idle")


def run_all(page, base: str, token: str, notebook: str) -> list[str]:
    """Open notebooks/<notebook>.ipynb, Run All Cells from the Run menu, wait until it finished; returns the
    code cells' prompts after asserting that no cell raised and every one ran."""
    page.goto(f"{base}/lab/tree/notebooks/{notebook}.ipynb?reset&token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    _wait_for_idle_kernel(base, token, notebook)  # before Run All, else the run waits on the kernel picker
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    try:
        page.wait_for_function(RUN_FINISHED, timeout=300_000)
    except Exception:
        page.screenshot(path=str(Path(os.environ.get("MINISGL_SCREENSHOT_DIR", "/tmp")) / f"stuck_{notebook}.png"))
        raise
    prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_text_contents()
    errors = [t[:800] for t in page.locator(".jp-RenderedText").all_text_contents()
              if "Traceback" in t or "Error:" in t]
    assert not errors, f"a cell of {notebook} raised in JupyterLab:\n" + "\n---\n".join(errors)
    unrun = [i for i, t in enumerate(prompts) if not any(ch.isdigit() for ch in t)]
    assert not unrun, f"code cells of {notebook} that did not run: {unrun} of {len(prompts)}"
    dismiss_news(page)
    return prompts


def dismiss_news(page) -> None:
    """JupyterLab's "notified about official Jupyter news?" toast, out of the way of the screenshots."""
    no_news = page.locator(".jp-toast-button", has_text="No")
    if no_news.count():
        no_news.first.click()


def figure_shot(page, figure, path: Path) -> None:
    """A screenshot of one figure's output area, scrolled into view and laid out."""
    figure.scroll_into_view_if_needed()
    page.wait_for_timeout(500)  # let plotly finish laying out the figure
    figure.locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea-child')][1]").screenshot(path=str(path))


def test_students_see_the_student_tools_only(jupyterlab, browser, shots):
    base, token = jupyterlab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(120_000)
    page.goto(f"{base}/lab/tree/notebooks/00_tour.ipynb?reset&token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    page.wait_for_selector(".lm-MenuBar-itemLabel >> text=Kernel")
    menus = page.locator(".lm-MenuBar-itemLabel").all_text_contents()
    assert "Nbgrader" not in menus, f"the instructor's Nbgrader menu is visible: {menus}"
    sidebars = " ".join(page.locator(".lm-TabBar-tab").all_inner_texts() +
                        [t or "" for t in page.locator(".lm-TabBar-tab").evaluate_all(
                            "tabs => tabs.map(t => t.getAttribute('title') || t.getAttribute('data-id'))")])
    assert "Create Assignment" not in sidebars and "create_assignment" not in sidebars.lower(), sidebars
    assert page.locator(".jp-Toolbar button, .jp-Toolbar .jp-ToolbarButtonComponent", has_text="Validate").count(), \
        "nbgrader's Validate button (a student tool) is gone"
    try:  # the formgrader's server extension is off too
        urllib.request.urlopen(f"{base}/formgrader?token={token}", timeout=10).close()
        formgrader = 200
    except urllib.error.HTTPError as e:
        formgrader = e.code
    assert formgrader == 404, f"/formgrader answers {formgrader}"
    dismiss_news(page)
    page.wait_for_timeout(500)
    page.screenshot(path=str(shots / "browser_student_jupyterlab.png"))
    page.close()


def test_notebook_04_renders_the_tree_and_the_stepper(jupyterlab, browser, shots):
    base, token = jupyterlab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(120_000)
    prompts = run_all(page, base, token, "04_radix_cache")
    page.wait_for_selector(".js-plotly-plot .main-svg", state="attached")
    plots = page.locator(".js-plotly-plot")
    assert plots.count() >= 2, "the tree figure and the stepper's tree"
    tree = plots.first
    assert "pages [" in tree.inner_text(), "the tree's node labels"
    figure_shot(page, tree, shots / "browser_04_radix_tree.png")

    page.wait_for_selector(".jupyter-widgets button, .widget-button", state="attached")
    text = page.locator(".jp-Notebook").inner_text()
    assert "Loading widget" not in text, "an ipywidgets view never rendered"
    assert page.locator(".widget-text input, .jupyter-widgets input").count() >= 1
    # the stepper's plotly tree lives inside the widgets' Output area
    stepper_plot = ".widget-output .js-plotly-plot, .jupyter-widgets .js-plotly-plot"
    assert page.locator(stepper_plot).count() >= 1
    # the widget is live: a click runs the callback in the kernel, which redraws the tree
    button = page.locator(".jupyter-widgets button, .widget-button").first
    page.locator(".jupyter-widgets input").first.fill("evict 4")
    button.click()
    page.wait_for_selector("text=/evict 4: freed/", state="attached", timeout=60_000)
    page.wait_for_selector(".widget-output .js-plotly-plot .main-svg, .jupyter-widgets .js-plotly-plot .main-svg",
                           state="attached")
    box = page.locator(".jupyter-widgets.widget-vbox, .widget-vbox").first
    box.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    box.screenshot(path=str(shots / "browser_04_radix_stepper.png"))
    print(f"04: {len(prompts)} code cells ran; {plots.count()} plotly figures; the stepper ran `evict 4`")
    page.close()


def test_notebook_07_renders_the_kernel_timeline(jupyterlab, browser, shots):
    base, token = jupyterlab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(120_000)
    prompts = run_all(page, base, token, "07_overlap")
    page.wait_for_selector(".js-plotly-plot .main-svg", state="attached")
    timeline = page.locator(".js-plotly-plot", has_text="GPU busy").first
    lanes = timeline.inner_text()
    for lane in ("matmul", "attention", "norm / rope / activation", "memory copy", "GPU busy"):
        assert lane in lanes, f"the timeline has no {lane!r} lane: {lanes[:300]}"
    figure_shot(page, timeline, shots / "browser_07_timeline.png")
    print(f"07: {len(prompts)} code cells ran; the timeline's lanes are drawn")
    page.close()
