"""The course in a real browser: JupyterLab serving a released notebook, driven by headless Chromium.

A student works in JupyterLab, where plotly figures and ipywidgets are drawn by JupyterLab extensions that
nbval/nbclient never load: a figure saved as JSON can still fail to render, and a widget can stay at
"Loading widget...". This test builds a release, fills notebooks 00-04 with the reference solutions and
exports them (a student who has finished notebook 04: its radix-tree stepper draws a plotly tree inside an
ipywidgets Output next to a Text box and a Button), starts JupyterLab on 127.0.0.1 (free port, token), opens
notebooks/04_radix_cache.ipynb in Debian's `/usr/bin/chromium` driven by Playwright, runs all cells from the
Run menu, and asserts every code cell ran, a plotly figure rendered and the widgets rendered. The screenshot
goes to $MINISGL_SCREENSHOT_DIR (else the test's temp dir).

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
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("MINISGL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NOTEBOOK = "04_radix_cache"
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


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "ok")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def student_release(tmp_path_factory):
    """A release in which notebooks 00..04 hold the reference solutions and are exported."""
    sys.path.insert(0, str(REPO / "autograder"))
    import course
    import gate

    tmp = tmp_path_factory.mktemp("browser")
    out = tmp / "release"
    course.release(out, tmp / "work")
    for nb in course.notebook_paths(out / "notebooks"):
        if nb.name <= f"{NOTEBOOK}.ipynb":
            gate.fill(nb, REPO / "notebooks" / nb.name)
    subprocess.run([sys.executable, "autograder/course.py", "export"], cwd=out, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def jupyterlab(student_release, tmp_path_factory):
    """JupyterLab on 127.0.0.1 serving the release; yields its base URL with the token."""
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
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         "--ServerApp.port_retries=0", "--allow-root", f"--IdentityProvider.token={token}",
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


def _wait_for_idle_kernel(base: str, token: str, timeout: float = 120) -> None:
    """Until the notebook's kernel (started when the page opened it) reports idle, through the server's API."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=5) as r:
            sessions = json.load(r)
        if any(s["path"].endswith(f"{NOTEBOOK}.ipynb") and s["kernel"]["execution_state"] == "idle" for s in sessions):
            return
        time.sleep(0.5)
    pytest.fail(f"the kernel of {NOTEBOOK} never became idle")


def test_released_notebook_renders_plotly_and_widgets(jupyterlab, tmp_path):
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab
    shots = Path(os.environ.get("MINISGL_SCREENSHOT_DIR", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(f"{base}/lab/tree/notebooks/{NOTEBOOK}.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell")
            # the kernel must be up before Run All, else the run waits on the kernel picker
            _wait_for_idle_kernel(base, token)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            # done: no cell queued or running, and every code cell has an execution count
            page.wait_for_function(RUN_FINISHED, timeout=300_000)
            prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_text_contents()
            errors = [t[:800] for t in page.locator(".jp-RenderedText").all_text_contents()
                      if "Traceback" in t or "Error:" in t]
            assert not errors, "a cell raised in JupyterLab:\n" + "\n---\n".join(errors)
            unrun = [i for i, t in enumerate(prompts) if not any(ch.isdigit() for ch in t)]
            assert not unrun, f"code cells that did not run: {unrun} of {len(prompts)}"

            page.wait_for_selector(".js-plotly-plot .main-svg", state="attached")
            n_plots = page.locator(".js-plotly-plot").count()
            assert n_plots >= 1
            page.wait_for_selector(".jupyter-widgets button, .widget-button", state="attached")
            button = page.locator(".jupyter-widgets button, .widget-button").first
            button.scroll_into_view_if_needed()
            page.wait_for_timeout(500)  # let plotly finish laying out the figure in the widget's Output
            text = page.locator(".jp-Notebook").inner_text()
            assert "Loading widget" not in text, "an ipywidgets view never rendered"
            assert page.locator(".widget-text input, .jupyter-widgets input").count() >= 1
            # the stepper's plotly tree lives inside the widgets' Output area
            assert page.locator(".jupyter-widgets .js-plotly-plot, .widget-output .js-plotly-plot").count() >= 1
            # the widget is live: a click runs the callback in the kernel, which redraws the tree
            box = page.locator(".jupyter-widgets input").first
            box.fill("evict 4")
            button.click()
            page.wait_for_selector("text=/evict 4: freed/", state="attached", timeout=60_000)
            page.wait_for_selector(".widget-output .js-plotly-plot .main-svg, "
                                   ".jupyter-widgets .js-plotly-plot .main-svg", state="attached")
            no_news = page.locator(".jp-toast-button", has_text="No")  # JupyterLab's "official news?" toast
            if no_news.count():
                no_news.first.click()
            button.scroll_into_view_if_needed()
            page.evaluate("document.querySelector('.widget-output .js-plotly-plot, .jupyter-widgets .js-plotly-plot')"
                          ".scrollIntoView({block: 'end'})")
            page.wait_for_timeout(500)
            shot = shots / f"browser_{NOTEBOOK}.png"
            page.screenshot(path=str(shot))
            print(f"{len(prompts)} code cells ran; {n_plots} plotly figure(s); the stepper's button ran "
                  f"`evict 4` in the kernel; screenshot {shot}")
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
