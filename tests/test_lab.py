"""A paper notebook as a user opens it: JupyterLab started here on 127.0.0.1, driven by playwright through Debian's
chromium (never `playwright install`), Run All of a copy of the notebook. Checked: no kernel dialog, the smoke profile
ran (its results file and time), no error output, each plotly figure rendered once, a widget change redraws its output.
Screenshots go to runs/screenshots/."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kimi_papers.core.runner import kill_tree, process_tree

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# a paper notebook with plotly figures (some cells end in `viz.show(...)`, where a figure shown twice would appear) and a
# dropdown in its widget explorer; smoke in well under 60 s
NOTEBOOK = tuple(os.environ.get("KIMI_PAPERS_LAB_NOTEBOOK", "architectures/hyperbolic_flow").split("/"))
SMOKE_LIMIT_S = 60
pytestmark = pytest.mark.timeout(420)

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # CI installs it (requirements.txt); elsewhere say what is missing
    sync_playwright = None


def _require_browser() -> None:
    missing = [what for what, ok in (("playwright (pip)", sync_playwright is not None),
                                     ("chromium (apt)", Path(CHROMIUM).is_file())) if not ok]
    if missing and os.environ.get("CI"):
        pytest.fail(f"the browser test needs {', '.join(missing)}; .ci/run installs both")
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A Lab server on a copy of the notebook (autosave can never touch nbs/), results to a scratch folder."""
    _require_browser()
    tmp = tmp_path_factory.mktemp("lab")
    folder, slug = NOTEBOOK
    (tmp / "nbs" / folder).mkdir(parents=True)
    shutil.copy(ROOT / "nbs" / folder / f"{slug}.ipynb", tmp / "nbs" / folder / f"{slug}.ipynb")
    settings = tmp / "user-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)  # render every cell (no windowing), so the DOM holds every output
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "KIMI_PAPERS_HEADLESS")}  # a person's Lab
    env.update({"KIMI_PAPERS_PATHS_RESULTS_DIR": str(tmp / "results"), "OMP_NUM_THREADS": "1",
                "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(tmp / "user-settings"),
                "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces")})
    cmd = [str(BIN / "jupyter"), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.token=",
           "--ServerApp.password=", "--LabApp.expose_app_in_browser=True", f"--ServerApp.root_dir={tmp / 'nbs'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp / "lab.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() - t0 < 90, (tmp / "lab.log").read_text()[-3000:]
            time.sleep(0.5)
    yield url, tmp
    kill_tree(process_tree(proc.pid), 5.0)
    log.close()


JS_STATE = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  const kernel = nb.sessionContext.session && nb.sessionContext.session.kernel;
  const code = nb.content.widgets.filter(c => c.model.type === 'code');
  const outs = code.map(c => c.model.outputs.toJSON());
  const plotly = outs.map(o => o.filter(x => x.data && x.data['application/vnd.plotly.v1+json']));
  const rendered = code.map(c => Array.from(c.node.querySelectorAll('.jp-Cell-outputArea .js-plotly-plot'))
                                      .filter(e => !e.closest('.jupyter-widgets')).length);
  return {status: kernel ? kernel.status : 'none', n: code.length,
          executed: code.filter(c => c.model.executionCount !== null).length,
          errors: outs.flatMap((o, i) => o.filter(x => x.output_type === 'error').map(x => `cell ${i}: ${x.ename}: ${x.evalue}`)),
          plotly: plotly.map(p => p.length), rendered: rendered,
          duplicated: plotly.map(p => p.length - new Set(p.map(x => JSON.stringify(x.data['application/vnd.plotly.v1+json']))).size)};
}"""


def _settle(page, timeout_s: float) -> dict:
    """Poll until every code cell ran (or one failed) and the kernel stayed idle for two polls; the last state."""
    t0, calm = time.monotonic(), 0
    while time.monotonic() - t0 < timeout_s:
        s = page.evaluate(JS_STATE)
        done = s["status"] == "idle" and (s["executed"] == s["n"] or s["errors"])
        calm = calm + 1 if done else 0
        if calm >= 2:
            return s
        time.sleep(1.0)
    raise AssertionError(f"Run All did not finish in {timeout_s:.0f} s: {page.evaluate(JS_STATE)}")


def test_run_all_in_lab_runs_the_smoke_profile_cleanly(lab):
    url, tmp = lab
    folder, slug = NOTEBOOK
    shots = ROOT / "runs" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/{folder}/{slug}.ipynb")
            page.wait_for_function("() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                                   " return w && w.sessionContext && w.sessionContext.session &&"
                                   " w.sessionContext.session.kernel && w.sessionContext.session.kernel.status === 'idle'; }",
                                   timeout=120_000)
            assert page.locator(".jp-Dialog").count() == 0, "a dialog opened with the notebook (kernel selection?)"
            t0 = time.monotonic()
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            state = _settle(page, 240)
            took = time.monotonic() - t0
            page.screenshot(path=str(shots / f"lab_{slug}_run_all.png"), full_page=False)
            assert not state["errors"], state["errors"]
            assert state["executed"] == state["n"], state
            assert page.locator(".jp-Dialog").count() == 0
            recorded = json.loads((tmp / "results" / f"{slug}.json").read_text())
            profiles = {prof for item in recorded["claims"].values() for prof in item.get("runs", {})}
            assert profiles == {"smoke"}, f"Run All recorded {profiles}: the committed notebook must re-run as smoke"
            assert took < SMOKE_LIMIT_S, f"Run All took {took:.0f} s"
            assert sum(state["plotly"]) >= 2, state["plotly"]
            assert state["rendered"] == state["plotly"], ("every plotly output rendered once in its cell",
                                                          state["rendered"], state["plotly"])
            assert not any(state["duplicated"]), f"a figure shown twice in one cell: {state['duplicated']}"

            dropdown = page.locator(".widget-dropdown select").first
            dropdown.scroll_into_view_if_needed()
            area = page.locator(".jupyter-widgets .widget-output").first
            before = area.inner_html()
            assert "js-plotly-plot" in before, "the explorer drew its figure"
            options = dropdown.locator("option").all_inner_texts()
            assert len(options) >= 2, options
            dropdown.select_option(label=next(o for o in options if o != dropdown.evaluate("e => e.selectedOptions[0].text")))
            page.wait_for_function("([el, old]) => el.innerHTML !== old && el.querySelector('.js-plotly-plot')",
                                   arg=[area.element_handle(), before], timeout=60_000)
            page.screenshot(path=str(shots / f"lab_{slug}_widget.png"), full_page=False)
        finally:
            browser.close()
