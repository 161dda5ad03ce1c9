"""The offline docs site: notebook processing, the remote-reference scan, the build, and a real render.

The browser tests open built pages in headless Chromium with every DNS lookup blocked and check that
plotly drew its SVG and MathJax typeset the math; a screenshot of each page is kept under
`runs/screenshots/` (a CI artifact).
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_SITE = ROOT / "tests" / "fixtures" / "docs_site"
FIXTURE_NB = FIXTURE_SITE / "fixtures" / "plotly_math.ipynb"
SCREENSHOTS = ROOT / "runs" / "screenshots"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
HIDDEN_MARKER = "this cell must not appear on the page"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bd = _load("kimi_build_docs", ROOT / "CI" / "build_docs.py")
sr = _load("kimi_sync_readme", ROOT / "CI" / "sync_readme.py")


def _run_build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "CI" / "build_docs.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


# ------------------------------------------------------------------- processing (no build needed)

def test_directives_are_parsed_and_stripped():
    assert bd.parse_directives("#| hide\nx = 1") == ({"hide": ""}, "x = 1")
    assert bd.parse_directives("#|export\ndef f(): pass") == ({"export": ""}, "def f(): pass")
    assert bd.parse_directives("#| echo: false\n#| output: False\nprint(1)") == (
        {"echo": "false", "output": "false"}, "print(1)")
    assert bd.parse_directives("#| default_exp core.config") == ({"default_exp": "core.config"}, "")
    assert bd.parse_directives("x = 1  #| hide_line\ny = 2\n# | not at the top") == ({}, "y = 2\n# | not at the top")


def test_fixture_notebook_is_processed_like_nbdev():
    nb = json.loads(FIXTURE_NB.read_text())
    original = copy.deepcopy(nb)
    out = bd.proc_notebook(bd._read_nb(FIXTURE_NB), fallback_title="x")
    assert nb == original  # the input is not modified
    text = json.dumps(out)
    assert HIDDEN_MARKER not in text  # `#| hide` cell dropped
    assert "#|" not in text  # directive lines stripped, the `default_exp`-only cell dropped
    assert "def softmax" in text  # exported code stays visible
    assert "widgets" not in out["metadata"]  # widget state would make myst-nb load a CDN script
    outs = [o for c in out["cells"] for o in c.get("outputs", [])]
    assert [set(o["data"]) for o in outs[:2]] == [{"text/html"}, {"text/html"}]  # both figures as offline HTML
    for o in outs[:2]:
        assert "plotly-graph-div" in o["data"]["text/html"] and "<script src" not in o["data"]["text/html"]
    assert [o["data"]["text/markdown"] for o in outs if "Interactive widget" in o["data"].get("text/markdown", "")] \
        == [bd.WIDGET_NOTE]  # the slider became a note; the tqdm bar was dropped
    assert len(outs) == 5
    assert "### softmax" in outs[2]["data"]["text/markdown"] and "\n---\n" not in "\n" + outs[2]["data"]["text/markdown"]
    assert out["metadata"]["language_info"]["name"] == "python"


def test_hide_echo_output_directives_on_cells():
    cell = {"cell_type": "code", "metadata": {}, "source": "#| echo: false\nprint(1)",
            "outputs": [{"output_type": "stream", "name": "stdout", "text": "1\n"}], "execution_count": 1}
    assert bd.proc_cell(cell)["metadata"]["tags"] == ["remove-input"]
    assert bd.proc_cell({**cell, "source": "#| output: false\nprint(1)"})["metadata"]["tags"] == ["remove-output"]
    assert bd.proc_cell({**cell, "source": "#| include: false\nprint(1)"}) is None
    assert bd.proc_cell({**cell, "source": "#|hide\nprint(1)"}) is None
    md = {"cell_type": "markdown", "metadata": {}, "source": "#| hide is text in markdown"}
    assert bd.proc_cell(md) == md


def test_notebook_without_heading_gets_a_title_and_run_note():
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"papermill": {"parameters": {"profile": "smoke"},
                                                                          "start_time": "2026-11-30T01:02:03"}},
          "cells": [{"cell_type": "markdown", "metadata": {}, "source": "no heading here"}]}
    out = bd.proc_notebook(nb, fallback_title="spec md")
    assert out["cells"][0]["source"] == "# spec md"
    assert "2026-11-30 01:02:03" in out["cells"][1]["source"] and "profile='smoke'" in out["cells"][1]["source"]
    assert "papermill" not in out["metadata"]


def test_gather_prefers_executed_copies(tmp_path):
    nbs, runs, extra = tmp_path / "nbs", tmp_path / "runs" / "20261130-010203", tmp_path / "extra"
    for p in [nbs / "index.ipynb", nbs / "core" / "config.ipynb", nbs / "serving" / "spec_md.ipynb",
              nbs / "serving" / "_draft.ipynb", nbs / ".ipynb_checkpoints" / "x.ipynb",
              runs / "spec_md.ipynb", runs / "core" / "config.ipynb", extra / "fixtures" / "f.ipynb"]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("{}")
    got = bd.gather(nbs, runs, [extra])
    assert sorted(map(str, got)) == ["core/config.ipynb", "fixtures/f.ipynb", "index.ipynb", "serving/spec_md.ipynb"]
    assert got[Path("serving/spec_md.ipynb")] == (runs / "spec_md.ipynb", nbs / "serving" / "spec_md.ipynb")
    assert got[Path("core/config.ipynb")][0] == runs / "core" / "config.ipynb"
    assert got[Path("index.ipynb")][0] == nbs / "index.ipynb"
    with pytest.raises(bd.DocsError, match="--executed"):
        bd.gather(nbs, tmp_path / "no-such-run")


# ------------------------------------------------------------------------ the remote-reference scan

@pytest.mark.parametrize("snippet", [
    '<script src="https://cdn.plot.ly/plotly-2.35.2.min.js"></script>',
    '<script src="//cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>',
    '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">',
    '<link rel="preload" as="font" href="https://example.org/f.woff2">',
    '<style>@import "https://fonts.googleapis.com/css2?family=Inter";</style>',
    '<style>@font-face { src: url(https://fonts.gstatic.com/s/inter.woff2) }</style>',
    '<div style="background: url(\'http://example.org/bg.png\')"></div>',
    '<img src="https://img.shields.io/badge/ci-passing-green">',
    '<script>require.config({paths: {plotly: "https://cdn.plot.ly/plotly-2.min"}});</script>',
    '<script>var s = document.createElement("script"); s.src = "https://example.org/x.js";</script>',
    '<script>Plotly.newPlot("d", [{"type": "scattergeo", "lat": [1]}], {}, {})</script>',
])
def test_scanner_flags_remote_resources(snippet):
    assert bd.scan_html(f"<html><head></head><body>{snippet}</body></html>"), snippet


def test_scanner_allows_hyperlinks_and_local_assets():
    page = ('<html><head><link rel="canonical" href="https://example.org/x.html">'
            '<link rel="stylesheet" href="_static/furo.css"><script src="_static/plotly.min.js"></script>'
            '<script async src="_static/mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"></script></head>'
            '<body><a href="https://arxiv.org/abs/2501.00001">paper</a>'
            '<pre>&lt;script src="https://cdn.plot.ly/x.js"&gt;</pre>'  # code shown as text loads nothing
            '<script>Plotly.newPlot("d", [{"type": "bar", "y": [1]}], {"template": {"data": '
            '{"scattergeo": [{"type": "scattergeo"}]}}}, {"plotlyServerURL": "https://plot.ly"})</script>'
            '</body></html>')
    assert bd.scan_html(page) == []


# -------------------------------------------------------------------------------- sync_readme

def test_readme_from_notebook():
    nb = {"cells": [
        {"cell_type": "markdown", "source": "# kimi\n\nSee [SpecMD](serving/spec_md.ipynb) and [arXiv](https://arxiv.org)."},
        {"cell_type": "code", "source": "#| hide\nsecret = 1", "outputs": []},
        {"cell_type": "code", "source": "#| echo: false\nshow()", "outputs": [
            {"output_type": "display_data", "data": {"text/markdown": "| a |\n|---|\n| 1 |", "text/plain": "x"}},
            {"output_type": "display_data", "data": {"application/vnd.plotly.v1+json": {}, "text/html": "<div>"}}]},
        {"cell_type": "code", "source": "print(2)", "outputs": [{"output_type": "stream", "name": "stdout", "text": "2\n"}]},
    ]}
    text = sr.readme_from_notebook(nb)
    assert text.startswith(sr.HEADER)
    body = text[len(sr.HEADER):]
    assert body == ("# kimi\n\nSee [SpecMD](nbs/serving/spec_md.ipynb) and [arXiv](https://arxiv.org).\n\n"
                    "| a |\n|---|\n| 1 |\n\n```python\nprint(2)\n```\n\n```\n2\n```\n")


def test_readme_check_mode(tmp_path):
    nb = tmp_path / "index.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": "# t"}]}))
    readme = tmp_path / "README.md"
    assert sr.main(["--notebook", str(nb), "--readme", str(readme), "--check"]) == 1
    assert not readme.exists()
    assert sr.main(["--notebook", str(nb), "--readme", str(readme)]) == 0
    assert sr.main(["--notebook", str(nb), "--readme", str(readme), "--check"]) == 0
    assert readme.read_text() == sr.HEADER + "# t\n"


# ------------------------------------------------------------------------------------ builds

@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The real site plus the fixture notebook and one recorded claim, built once per test session."""
    from filelock import FileLock
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, shared by its xdist workers (not by other sessions)
    out, done = shared / "kimi-docs-site", shared / "kimi-docs-site.ok"
    with FileLock(str(shared / "kimi-docs-site.lock")):
        if not done.exists():
            results = shared / "kimi-docs-results"
            from kimi_papers.core.ledger import Claim, record
            record(Claim(paper="docs_fixture", id="toy_claim", statement="The method beats the baseline",
                         paper_value="2x", setting="toy", metric="ratio", threshold=1.5, unit="x"),
                   [2.0, 2.1, 2.2], "smoke", seeds=[0, 1, 2], folder=results)
            record(Claim(paper="docs_fixture", id="toy_identity", statement="The two paths agree", paper_value="-",
                         setting="toy", metric="max abs error", threshold=1e-6, direction="<=", kind="mechanics"),
                   0.0, "smoke", folder=results)
            r = _run_build("--extra", str(FIXTURE_SITE), "--results", str(results), "--out", str(out))
            assert r.returncode == 0, r.stdout + r.stderr
            print(r.stdout)
            done.write_text(r.stdout)
    return out


def test_site_has_every_page(site):
    for page in ["index.html", "board.html", "api/index.html", "api/kimi_papers.core.config.html",
                 "core/index.html", "core/config.html", "fixtures/index.html", "fixtures/plotly_math.html",
                 "search.html", "_static/plotly.min.js", "_static/mathjax/MathJax.js",
                 "_static/mathjax/config/TeX-AMS-MML_HTMLorMML-full.js"]:
        assert (site / page).is_file(), page
    for nb in (ROOT / "nbs").rglob("*.ipynb"):
        rel = nb.relative_to(ROOT / "nbs")
        if not bd._visible(rel) or rel.name == "index.ipynb":
            continue
        assert (site / rel.with_suffix(".html")).is_file(), f"no page for nbs/{rel}"
    page = (site / "fixtures" / "plotly_math.html").read_text()
    assert HIDDEN_MARKER not in page and "#| export" not in page and "def" in page
    assert 'src="../_static/plotly.min.js"' in page.split("</head>")[0]  # in the head, before the figures
    assert "MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe" in page
    board = (site / "board.html").read_text()
    assert "The method beats the baseline" in board and ">reproduced</span>" in board
    assert "2.1 [" in board and "x (n=3)" in board  # the estimate with its interval, unit and n
    assert board.index("<h3>Paper claims") < board.index("<h3>Mechanics") < board.index("The two paths agree")
    api = (site / "api" / "kimi_papers.core.ledger.html").read_text()
    assert "record" in api and "core/ledger.html" in api  # linked to its notebook page


def test_built_site_has_no_remote_references(site, tmp_path):
    assert bd.find_remote_refs(site) == []
    # the scanner really looks at built pages: inject a CDN script into a copy of one
    page = (site / "fixtures" / "plotly_math.html").read_text()
    bad = tmp_path / "fixtures" / "plotly_math.html"
    bad.parent.mkdir()
    bad.write_text(page.replace("</head>", '<script src="https://cdn.plot.ly/plotly-3.0.1.min.js"></script></head>', 1))
    assert bd.find_remote_refs(tmp_path) == [
        "fixtures/plotly_math.html: <script src='https://cdn.plot.ly/plotly-3.0.1.min.js'>"]


def _tiny_notebook(html_output: str) -> dict:
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "markdown", "id": "a", "metadata": {}, "source": "# Tiny\n\n> a page"},
        {"cell_type": "code", "id": "b", "metadata": {}, "execution_count": 1, "source": "fig",
         "outputs": [{"output_type": "display_data", "metadata": {}, "data": {"text/html": html_output}}]}]}


def test_build_fails_on_a_cdn_reference_and_keeps_the_old_site(tmp_path):
    nbs = tmp_path / "nbs" / "serving"
    nbs.mkdir(parents=True)
    (nbs / "tiny.ipynb").write_text(json.dumps(_tiny_notebook(
        '<script src="https://cdn.plot.ly/plotly-2.35.2.min.js"></script><div>fig</div>')))
    out = tmp_path / "site"
    out.mkdir()
    (out / "old.html").write_text("previous build")
    (tmp_path / "results").mkdir()
    args = ["--nbs", str(tmp_path / "nbs"), "--no-api", "--results", str(tmp_path / "results"), "--out", str(out)]
    r = _run_build(*args)
    assert r.returncode == 1
    assert "serving/tiny.html: <script src='https://cdn.plot.ly/plotly-2.35.2.min.js'>" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["old.html"]  # the previous site is untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".docs-build-")] == []
    # the same notebook without the CDN script builds, and replaces the old site in one rename
    (nbs / "tiny.ipynb").write_text(json.dumps(_tiny_notebook("<div>fig</div>")))
    r = _run_build(*args)
    assert r.returncode == 0, r.stderr
    assert (out / "serving" / "tiny.html").is_file() and not (out / "old.html").exists()


def test_build_fails_on_a_sphinx_warning(tmp_path):
    nbs = tmp_path / "nbs" / "rl"
    nbs.mkdir(parents=True)
    nb = _tiny_notebook("<div>fig</div>")
    nb["cells"][0]["source"] += "\n\nSee [a missing page](missing_page.ipynb)."
    (nbs / "tiny.ipynb").write_text(json.dumps(nb))
    (tmp_path / "results").mkdir()
    r = _run_build("--nbs", str(tmp_path / "nbs"), "--no-api", "--results", str(tmp_path / "results"),
                   "--out", str(tmp_path / "site"))
    assert r.returncode == 1 and "missing_page" in r.stderr and "sphinx-build failed" in r.stderr
    assert not (tmp_path / "site").exists()


# ------------------------------------------------------------------------- headless Chromium

def _chromium(page: Path, tmp: Path, screenshot: Path) -> tuple[str, str]:
    """(DOM after scripts ran, console log) of `page` in headless Chromium with all DNS blocked."""
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run installs it with apt-get install -y chromium")
        pytest.skip("chromium not installed here (apt-get install -y chromium); CI installs it and runs this")
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp / 'chromium-profile'}",
           "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
           "--virtual-time-budget=8000", "--hide-scrollbars", "--window-size=1280,1800",
           "--enable-logging=stderr", "--v=0", "--dump-dom", f"--screenshot={screenshot}", page.as_uri()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert r.returncode == 0, r.stderr[-3000:]
    console = "\n".join(ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln)
    return r.stdout, console


def _check_rendered(page: Path, tmp: Path, name: str) -> str:
    static = page.read_text()
    figures = static.count('class="plotly-graph-div"')
    shot = SCREENSHOTS / f"{name}.png"
    shot.unlink(missing_ok=True)
    dom, console = _chromium(page, tmp, shot)
    shot.with_suffix(".dom.html").write_text(dom)  # kept beside the screenshot for diagnosis
    assert figures >= 1, f"{page} has no plotly figure to check"
    assert dom.count("js-plotly-plot") == figures, "not every plotly figure was drawn"
    assert dom.count('class="main-svg"') >= figures
    if 'class="math notranslate' in static:
        assert dom.count('class="MathJax"') >= static.count('class="math notranslate'), "math not typeset"
        assert "Math Processing Error" not in dom and 'class="MathJax_Error"' not in dom
    assert "Uncaught" not in console, console
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    return dom


@pytest.mark.browser
def test_fixture_page_renders_offline(site, tmp_path):
    dom = _check_rendered(site / "fixtures" / "plotly_math.html", tmp_path, "docs-fixture-plotly_math")
    assert dom.count('class="MathJax"') >= 2  # the inline formula and the display equation


@pytest.mark.browser
def test_spec_md_page_renders_offline(site, tmp_path):
    nb = ROOT / "nbs" / "serving" / "spec_md.ipynb"
    if not nb.exists():
        pytest.skip("nbs/serving/spec_md.ipynb does not exist yet (the fixture page is checked instead)")
    if not any(c.get("outputs") for c in json.loads(nb.read_text())["cells"]):
        pytest.skip("nbs/serving/spec_md.ipynb is committed without outputs: record its full run first")
    page = site / "serving" / "spec_md.html"
    _check_rendered(page, tmp_path, "docs-serving-spec_md")


@pytest.mark.browser
@pytest.mark.parametrize("rel", ["serving/spec_md", "rl/pmd_mean", "rl/optimal_token_baseline"])
def test_paper_page_opens_with_results_at_a_glance(site, tmp_path, rel):
    nb = ROOT / "nbs" / f"{rel}.ipynb"
    if not any(c.get("outputs") for c in json.loads(nb.read_text())["cells"]):
        pytest.skip(f"nbs/{rel}.ipynb is committed without outputs: record its full run first")
    page = site / f"{rel}.html"
    text = page.read_text()
    assert "Results at a glance" in text, f"{rel}: no Results at a glance"
    assert text.index("Results at a glance") < text.index("The idea"), f"{rel}: the verdicts must come before the method"
    assert "injected-parameters" not in text and "# Parameters" not in text  # papermill's injected cell is hidden
    _check_rendered(page, tmp_path, f"docs-{rel.replace('/', '-')}")


@pytest.mark.browser
def test_board_page_renders_offline(site, tmp_path):
    _check_rendered(site / "board.html", tmp_path, "docs-board")


@pytest.mark.browser
def test_render_check_fails_without_local_plotly(site, tmp_path):
    """The render check can fail: the same page without its plotly.js draws nothing."""
    page = (site / "fixtures" / "plotly_math.html").read_text()
    assert '<script src="../_static/plotly.min.js"></script>' in page
    (tmp_path / "_static").symlink_to(site / "_static")  # same relative layout, the shared site untouched
    broken = tmp_path / "fixtures" / "no_plotly.html"
    broken.parent.mkdir()
    broken.write_text(page.replace('<script src="../_static/plotly.min.js"></script>', ""))
    dom, console = _chromium(broken, tmp_path, tmp_path / "broken.png")
    assert 'class="main-svg"' not in dom
    assert "Plotly is not defined" in console


# ------------------------------------------------------------- every paper page in a real browser (playwright)

JS_LAYOUT = """() => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const hit = (a, b) => a[0] < b[2] - 1 && b[0] < a[2] - 1 && a[1] < b[3] - 1 && b[1] < a[3] - 1;
  const out = {divs: document.querySelectorAll('.plotly-graph-div').length,
               drawn: document.querySelectorAll('.js-plotly-plot').length, overlaps: [],
               math: document.querySelectorAll('.math').length, typeset: document.querySelectorAll('span.MathJax').length};
  document.querySelectorAll('.js-plotly-plot').forEach((plot, i) => {
    const legend = plot.querySelector('.legend');
    if (!legend || legend.getBoundingClientRect().width === 0) return;
    const titles = [...plot.querySelectorAll('.g-gtitle text, .infolayer .annotation-text')]
      .filter(t => t.textContent.trim() && t.getBoundingClientRect().width > 0);
    titles.forEach(t => { if (hit(box(legend), box(t))) out.overlaps.push(`figure ${i}: legend over "${t.textContent.trim().slice(0, 60)}"`); });
  });
  return out;
}"""


def _paper_pages(site: Path) -> list:
    return sorted(p for folder in ("agents", "architectures", "decoding", "evaluation", "rl", "safety", "science", "serving")
                  for p in (site / folder).glob("*.html") if p.name != "index.html")


# The paper pages are checked in PAGE_BATCHES interleaved batches (pages[b::PAGE_BATCHES]), so pytest-xdist can spread
# the browser work over its workers; together the batches visit every paper page exactly once.
PAGE_BATCHES = 4

# Settled: MathJax has nothing queued, and the figures' draw state and the legend / title boxes read the same in two
# consecutive polls (plotly finishes automargin redraws asynchronously after `load`).
JS_SETTLED = """() => {
  if (window.MathJax && MathJax.Hub && MathJax.Hub.queue.pending !== 0) return false;
  const r = e => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom].map(Math.round).join(","); };
  const sig = document.querySelectorAll('.js-plotly-plot').length + "|" + document.querySelectorAll('span.MathJax').length + "|" +
    [...document.querySelectorAll('.js-plotly-plot .legend, .js-plotly-plot .g-gtitle text, .js-plotly-plot .infolayer .annotation-text')]
      .map(r).join(";");
  const same = window.__kimiLayoutSig === sig;
  window.__kimiLayoutSig = sig;
  return same;
}"""


def _check_paper_pages(site: Path, pages: list[Path]) -> list[str]:
    """Problems found on `pages` (served over http from `site`) in one headless Chromium tab that navigates from page to
    page (the renderer and the HTTP cache are reused; every page is a fresh document)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:  # no access log on stderr
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # each request is tagged with the page (index) that issued it, so a request of page i that fails or is cut off
    # after its checks (when the tab moves on) is never blamed on page i + 1
    problems, failed, born, now = [], [], {}, [0]
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.on("request", lambda r: born.__setitem__(r, now[0]))
            page.on("requestfailed", lambda r: failed.append((born.get(r, now[0]), r.url)))
            page.on("response", lambda r: failed.append((born.get(r.request, now[0]), f"{r.status} {r.url}"))
                    if r.status >= 400 else None)
            for i, page_path in enumerate(pages):
                rel = page_path.relative_to(site).as_posix()
                now[0] = i
                page.goto(f"http://127.0.0.1:{server.server_port}/{rel}", wait_until="load")
                page.wait_for_function("() => !window.MathJax || !MathJax.Hub || MathJax.Hub.queue.pending === 0",
                                       timeout=60_000)
                try:  # a page that never settles (a figure that is never drawn) is reported by the checks below
                    page.wait_for_function(JS_SETTLED, polling=100, timeout=10_000)
                except PlaywrightTimeout:
                    pass
                s = page.evaluate(JS_LAYOUT)
                bad = [f for at, f in failed if at == i and not f.endswith("favicon.ico")]
                if s["drawn"] != s["divs"]:
                    problems.append(f"{rel}: {s['drawn']} of {s['divs']} figures drawn")
                problems += [f"{rel}: {o}" for o in s["overlaps"]]
                if s["math"] and not s["typeset"]:
                    problems.append(f"{rel}: math not typeset")
                problems += [f"{rel}: request failed {f}" for f in bad]
            browser.close()
    finally:
        server.shutdown()
    return problems


@pytest.mark.browser
@pytest.mark.parametrize("batch", range(PAGE_BATCHES), ids=[f"batch{b}" for b in range(PAGE_BATCHES)])
def test_paper_pages_draw_every_figure_once_with_no_legend_over_a_title(site, batch):
    """Every paper page served over http: each plotly figure drawn, no legend box over a title or an annotation, math
    typeset, and no request failing (no missing font, script or image)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("needs playwright (pip)")
    if CHROMIUM is None:
        pytest.skip("needs chromium")
    pages = _paper_pages(site)
    assert len(pages) >= 28, pages
    mine = pages[batch::PAGE_BATCHES]
    assert mine, (batch, len(pages))
    problems = _check_paper_pages(site, mine)
    assert not problems, "\n".join(problems)
