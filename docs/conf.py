"""Sphinx configuration of the kimi_papers documentation site (built by `CI/build_docs.py`).

The sources are staged by `CI/build_docs.py` (processed notebooks, the board and the API pages) and
built with `sphinx-build -c docs`; this file only configures the build. Everything the pages load is
served from the site itself: plotly.js from the installed plotly package, MathJax 2.7 from the
`jupyter-server-mathjax` package (its trimmed build has no default config: it needs the `-full` config and
the STIX-Web font). The build script fails the build if a page references a remote script,
stylesheet, font or image.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

project = "kimi_papers"
author = "kimi_papers developers"
copyright = "kimi_papers developers"

extensions = ["myst_nb", "sphinx.ext.mathjax", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]

# API pages: autodoc renders the members of each module (its __all__), with [source] links from viewcode
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True  # show defaults as written, not as reprs with memory addresses
autodoc_mock_imports: list[str] = []
napoleon_google_docstring = True
napoleon_numpy_docstring = True
viewcode_line_numbers = True
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["kimi.css"]
exclude_patterns = ["_build", "**.ipynb_checkpoints", "_vendor"]

html_theme = "furo"
html_title = "kimi_papers"
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
html_theme_options = {"navigation_with_keys": True}

# notebooks arrive executed (committed full-run outputs or a `kimi-papers run` folder)
nb_execution_mode = "off"
nb_merge_streams = True
# markdown outputs (tables from `display(Markdown(...))`, nbdev's show_doc) parsed like markdown cells
nb_render_markdown_format = "myst"
nb_ipywidgets_js = {}  # never pull the widget manager from a CDN; widgets are replaced by a note
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
myst_dmath_double_inline = True
# myst's default rewrites MathJax's config for MathJax 3 and breaks MathJax 2
myst_update_mathjax = False
# notebooks by many authors skip heading levels; that is style, not a broken page
# ref.python: two papers may each define a class of the same short name (sage.Trace, spec_md_traces.Trace); the
# ambiguous cross-reference of a type hint is not an error in either page
suppress_warnings = ["myst.header", "misc.highlighting_failure", "ref.python"]

# MathJax 2.7 served locally; the trimmed build has no default config, so name the full one
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"
mathjax2_config = {
    "tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]], "processEscapes": True},
    "HTML-CSS": {"availableFonts": ["STIX-Web"], "preferredFont": "STIX-Web", "webFont": "STIX-Web",
                 "imageFont": None,
                 # the width-test font MathJax_Blank points at url('about:blank'), which Chromium refuses (a CORS
                 # error per page); a local() source fails silently, the same fallback without the error
                 "styles": {"@font-face": {"font-family": "MathJax_Blank", "src": "local('MathJax_Blank')"}}},
    "showMathMenu": False,
    "messageStyle": "none",
}


def _package_dir(name: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name!r} is not installed: pip install -r requirements.txt")
    return Path(list(spec.submodule_search_locations)[0])


def vendor_files() -> dict[str, Path]:
    """Site-relative `_static` paths of the vendored assets and where they come from."""
    return {"plotly.min.js": _package_dir("plotly") / "package_data" / "plotly.min.js",
            "mathjax": _package_dir("jupyter_server_mathjax") / "static"}


def _copy_vendor(app, exception) -> None:
    """Copy plotly.js and MathJax into the built site's `_static` after a successful html build."""
    if exception is not None or app.builder.format != "html":
        return
    static = Path(app.outdir) / "_static"
    for rel, src in vendor_files().items():
        dst = static / rel
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def setup(app):
    for src in vendor_files().values():  # fail early, before a long build, if an asset is missing
        if not src.exists():
            raise RuntimeError(f"missing offline asset {src}: reinstall plotly / jupyter-server-mathjax")
    app.connect("build-finished", _copy_vendor)
    app.connect("autodoc-process-docstring", _escape_plain_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


_RST_SPECIAL = re.compile(r"(?<!\\)([*|])|(?<=\w)_(?=\W|$)")


def _escape_plain_docstring(app, what, name, obj, options, lines) -> None:
    """Docstrings here are plain one-liners (`*arrays`, `|y|`, `x_`), not reST: escape what reST would misread.

    Text inside backticks is left alone (inline literals and roles keep their meaning)."""
    for i, line in enumerate(lines):
        parts = re.split(r"(`+[^`]*`+)", line)
        lines[i] = "".join(p if p.startswith("`") else _RST_SPECIAL.sub(lambda m: "\\" + m.group(0), p) for p in parts)
