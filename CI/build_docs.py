#!/usr/bin/env python
"""Build the offline documentation site from the executed notebooks (Sphinx + myst-nb + furo).

    python CI/build_docs.py [--executed runs/<ts>/] [--extra DIR ...] [--out _docs]

1. Gathers the notebooks: the committed `nbs/**/*.ipynb` (they hold the latest recorded full-run
   outputs); with `--executed DIR` the executed copies found there replace them (same layout).
2. Processes them the way nbdev does without Quarto: drops `#| hide` cells, strips `#|` directive
   lines from the code it shows (exported code stays visible: it is literate code), replaces
   widget outputs with a note, turns plotly-JSON-only outputs into offline HTML.
3. Writes the home page (`nbs/index.ipynb`), one page per notebook grouped by folder, the API
   reference (one page per module of `kimi_papers`) and the reproduction board (`data/results/`).
4. Runs `sphinx-build -W` (any warning fails) into a temporary folder, scans every page for remote
   scripts, stylesheets, fonts and images (a CDN reference fails the build), then swaps it into
   `--out` by renames. A failed build leaves the previous site untouched and nothing half-written.
"""
from __future__ import annotations

import argparse
import contextlib
import html
import html.parser
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NBS = ROOT / "nbs"

# folder -> title, in the order the site lists them (paper folders first, then the core library)
PAPER_GROUPS = {"rl": "Reinforcement learning", "architectures": "Architectures", "serving": "Serving",
                "decoding": "Decoding", "agents": "Agents", "evaluation": "Evaluation",
                "safety": "Safety", "science": "Science"}
CORE_GROUP = {"core": "Core library"}

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_NOTE = ("*Interactive widget: open this notebook in JupyterLab (`make lab`) to use it; "
               "static pages show no widgets.*")


class DocsError(RuntimeError):
    """The site cannot be built (a bad input, a Sphinx warning or a remote reference)."""


# ---------------------------------------------------------------- notebook processing (nbdev-like)

_DIRECTIVE = re.compile(r"^\s*#\s*\|\s*(.*?)\s*$")
_HIDE_LINE = re.compile(r"\s*#\s*\|\s*hide_line\s*$")


def parse_directives(source: str) -> tuple[dict[str, str], str]:
    """Split a code cell into its leading `#| key [value]` directives and the code that follows."""
    lines = source.splitlines()
    directives: dict[str, str] = {}
    i = 0
    while i < len(lines) and (not lines[i].strip() or _DIRECTIVE.match(lines[i])):
        m = _DIRECTIVE.match(lines[i])
        if m and m.group(1):
            key, value = (re.split(r":\s*|\s+", m.group(1), maxsplit=1) + [""])[:2]
            key, value = key.strip().lower(), value.lstrip(": ").strip()
            directives[key] = value.lower() if key in {"echo", "output", "include", "eval"} else value
        i += 1
    body = [ln for ln in lines[i:] if not _HIDE_LINE.search(ln)]
    return directives, "\n".join(body).strip("\n")


def _is_false(value: str) -> bool:
    return value.strip().lower() in {"false", "0", "no"}


def proc_outputs(outputs: list[dict]) -> list[dict]:
    """Outputs a static page can show: widgets become a note, plotly JSON becomes offline HTML."""
    out = []
    for o in outputs:
        data = o.get("data")
        if data is None:
            out.append(o)
            continue
        o = {**o, "data": dict(data)}
        if "text/markdown" in o["data"]:
            o["data"]["text/markdown"] = _strip_breaks(o["data"]["text/markdown"])
        if WIDGET_MIME in o["data"]:
            if _is_progress_bar(o["data"].get("text/plain", "")):
                continue  # tqdm.auto draws a widget bar in kernels; a static page has no use for it
            o["data"] = {"text/markdown": WIDGET_NOTE}
        elif PLOTLY_MIME in o["data"]:
            if "text/html" not in o["data"]:
                o["data"]["text/html"] = plotly_html(o["data"][PLOTLY_MIME])
            o["data"].pop(PLOTLY_MIME)
            o["data"].pop("text/plain", None)
        o.setdefault("metadata", {})
        out.append(o)
    return out


def _is_progress_bar(text: str) -> bool:
    """A tqdm bar drawn as a widget (its text form is the bar: `  0%|    | 0/3 [...]`)."""
    return bool(re.match(r"\s*(\d+%\|.*\||HBox\(children=\(HTML\(value=.*FloatProgress\()", text, re.S))


def _strip_breaks(md: str) -> str:
    """Drop thematic breaks (`---`, as nbdev's show_doc emits) from markdown output: docutils only
    allows a transition between sections, and an output is not one."""
    lines, fence = [], None
    for ln in md.splitlines():
        m = re.match(r"\s*(```+|~~~+)", ln)
        if m and (fence is None or m.group(1)[0] == fence[0]):
            fence = None if fence else m.group(1)
        if fence is None and re.fullmatch(r"\s{0,3}([-*_])(\s*\1){2,}\s*", ln):
            continue
        lines.append(ln)
    return "\n".join(lines)


def plotly_html(fig_json: dict) -> str:
    """An offline HTML fragment for a plotly figure given as JSON (plotly.js comes from the page)."""
    import plotly.io as pio
    fig = pio.from_json(json.dumps(fig_json), skip_invalid=True)
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, include_mathjax=False,
                       config={"displaylogo": False, "responsive": True})


def proc_cell(cell: dict) -> dict | None:
    """One cell as the site shows it, or None when nbdev would hide it."""
    cell = {**cell, "metadata": dict(cell.get("metadata", {}))}
    if cell["cell_type"] != "code":
        return cell
    if "injected-parameters" in cell["metadata"].get("tags", []):
        return None  # papermill's injected cell: the run note above says which parameters ran
    d, body = parse_directives("".join(cell.get("source", "")))
    if "hide" in d or _is_false(d.get("include", "true")):
        return None
    tags = list(cell["metadata"].get("tags", []))
    if _is_false(d.get("echo", "true")):
        tags.append("remove-input")
    if _is_false(d.get("output", "true")):
        tags.append("remove-output")
    outputs = proc_outputs(cell.get("outputs", []))
    if not body and not outputs:
        return None  # e.g. a cell holding only `#| default_exp`
    if not body:
        tags.append("remove-input")
    cell["source"], cell["outputs"] = body, outputs
    if tags:
        cell["metadata"]["tags"] = sorted(set(tags))
    return cell


def _has_heading(cells: list[dict]) -> bool:
    return any(c["cell_type"] == "markdown" and re.search(r"(?m)^#{1,6}\s+\S", "".join(c["source"]))
               for c in cells)


_FRONTMATTER = re.compile(r"^---\s*\n(.*?)\n---\s*$", re.S)


def _frontmatter_cell(cell: dict) -> dict | None:
    """A Quarto/nbdev YAML front-matter raw cell as a title + description markdown cell."""
    m = _FRONTMATTER.match("".join(cell.get("source", "")).strip())
    if cell["cell_type"] != "raw" or not m:
        return None
    meta = dict(re.findall(r"(?m)^(\w+):\s*(.+?)\s*$", m.group(1)))
    text = (f"# {meta['title'].strip(chr(34) + chr(39))}\n" if "title" in meta else "") + \
           (f"\n> {meta['description'].strip(chr(34) + chr(39))}\n" if "description" in meta else "")
    return {"cell_type": "markdown", "metadata": {}, "source": text} if text else {}


def run_note(nb: dict) -> str | None:
    """A line stating which papermill run produced the outputs, for executed copies."""
    pm = nb.get("metadata", {}).get("papermill")
    if not pm:
        return None
    params = ", ".join(f"`{k}={v!r}`" for k, v in (pm.get("parameters") or {}).items())
    when = (pm.get("start_time") or "")[:19].replace("T", " ")
    return (f"*Outputs from a papermill run started {when or 'at an unrecorded time'}"
            f"{' with ' + params if params else ''}.*")


def proc_notebook(nb: dict, fallback_title: str) -> dict:
    """The notebook as the site shows it (a new dict; the input is not modified)."""
    cells = []
    for c in nb.get("cells", []):
        fm = _frontmatter_cell(c)
        if fm is not None:
            if fm:
                cells.append(fm)
            continue
        c = proc_cell(c)
        if c is not None:
            cells.append(c)
    if not _has_heading(cells):
        cells.insert(0, {"cell_type": "markdown", "metadata": {}, "source": f"# {fallback_title}"})
    note = run_note(nb)
    if note:
        first_md = next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown")
        cells.insert(first_md + 1, {"cell_type": "markdown", "metadata": {}, "source": note})
    meta = {k: v for k, v in nb.get("metadata", {}).items() if k not in {"widgets", "papermill"}}
    meta.setdefault("kernelspec", {"name": "python3", "display_name": "Python 3", "language": "python"})
    meta.setdefault("language_info", {"name": "python", "pygments_lexer": "ipython3"})
    for i, c in enumerate(cells):
        c.setdefault("metadata", {})
        c.setdefault("id", f"kimi-cell-{i}")
        if c["cell_type"] == "code":
            c.setdefault("execution_count", None)
            c.setdefault("outputs", [])
    return {"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}


def describe(nb: dict) -> tuple[str, str]:
    """(title, one-line description) from nbdev's `# Title` + `> description` first markdown cell."""
    for c in nb.get("cells", []):
        if c["cell_type"] != "markdown":
            continue
        src = "".join(c["source"])
        title = re.search(r"(?m)^#\s+(.+?)\s*$", src)
        desc = re.search(r"(?m)^>\s*(.+?)\s*$", src)
        return (title.group(1) if title else ""), (desc.group(1) if desc else "")
    return "", ""


# ------------------------------------------------------------------------- links to repo files

_MD_LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")


def rewrite_repo_links(text: str, nb_dir: Path, stage_nb_dir: Path, stage_src: Path) -> str:
    """Links from a notebook to repository files outside `nbs/` (data, README): ship the file."""
    def fix(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target, re.I):
            return m.group(0)
        path_part = target.split("#", 1)[0]
        resolved = (nb_dir / path_part).resolve()
        try:
            rel = resolved.relative_to(ROOT)
        except ValueError:
            return m.group(0)
        if not resolved.is_file() or rel.parts[0] == "nbs":
            return m.group(0)
        dest = stage_src / "_files" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(resolved, dest)
        return m.group(1) + os.path.relpath(dest, stage_nb_dir) + m.group(3)
    return _MD_LINK.sub(fix, text)


# ------------------------------------------------------------------------------ gathering sources

def _visible(rel: Path) -> bool:
    """nbdev skips files and folders whose names start with `_` or `.`."""
    return not any(p.startswith(("_", ".")) for p in rel.parts)


def gather(nbs: Path = NBS, executed: Path | None = None, extra: Iterable[Path] = ()) -> dict[Path, tuple[Path, Path]]:
    """{site-relative path: (file to read, its place under nbs/)} for every notebook of the site."""
    found = {rel: (p, nbs / rel) for p in sorted(nbs.rglob("*.ipynb"))
             if _visible(rel := p.relative_to(nbs))}
    if executed is not None:
        if not executed.is_dir():
            raise DocsError(f"--executed {executed}: expected a folder of executed notebooks")
        by_name: dict[str, list[Path]] = {}
        for rel in found:
            by_name.setdefault(rel.name, []).append(rel)
        for p in sorted(executed.rglob("*.ipynb")):
            rel = p.relative_to(executed)
            if not _visible(rel):
                continue
            if rel not in found and len(by_name.get(rel.name, [])) == 1:
                rel = by_name[rel.name][0]  # a flat run folder: place it where its source lives
            found[rel] = (p, nbs / rel)
    for d in extra:
        if not d.is_dir():
            raise DocsError(f"--extra {d}: expected a folder of notebooks")
        for p in sorted(d.rglob("*.ipynb")):
            if _visible(rel := p.relative_to(d)):
                found[rel] = (p, p)
    return found


def _read_nb(path: Path) -> dict:
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DocsError(f"{path}: not a readable notebook ({e})") from None
    if nb.get("nbformat") != 4 or not isinstance(nb.get("cells"), list):
        raise DocsError(f"{path}: expected an nbformat 4 notebook")
    for c in nb["cells"]:  # nbformat allows a list of lines or one string
        c["source"] = "".join(c.get("source", ""))
        for o in c.get("outputs", []):
            for k, v in (o.get("data") or {}).items():
                if isinstance(v, list):
                    o["data"][k] = "".join(v)
            if isinstance(o.get("text"), list):
                o["text"] = "".join(o["text"])
    return nb


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _groups(rels: Iterable[Path]) -> dict[str, list[Path]]:
    """Folder -> its notebooks, in site order (known paper folders, other folders, core)."""
    by: dict[str, list[Path]] = {}
    for rel in sorted(rels):
        if len(rel.parts) > 1:
            by.setdefault(rel.parts[0], []).append(rel)
    order = [g for g in PAPER_GROUPS if g in by] + sorted(g for g in by if g not in PAPER_GROUPS | CORE_GROUP) \
        + [g for g in CORE_GROUP if g in by]
    return {g: by[g] for g in order}


def group_title(folder: str) -> str:
    return {**PAPER_GROUPS, **CORE_GROUP}.get(folder, folder.replace("_", " ").capitalize())


def _doc(rel: Path) -> str:
    return rel.with_suffix("").as_posix()


def group_page(folder: str, rels: list[Path], infos: dict[Path, tuple[str, str]]) -> str:
    """A folder's landing page: its notebooks with their one-line descriptions."""
    lines = [f"# {group_title(folder)}", ""]
    for rel in rels:
        title, desc = infos[rel]
        lines.append(f"- {{doc}}`{Path(*rel.parts[1:]).with_suffix('').as_posix()}`" + (f" — {desc}" if desc else ""))
    lines += ["", "```{toctree}", ":hidden:", ""] + [Path(*r.parts[1:]).with_suffix("").as_posix() for r in rels] + ["```", ""]
    return "\n".join(lines)


def root_toctree(groups: dict[str, list[Path]], api: bool) -> str:
    """The hidden toctrees that give the site its navigation (appended to the home page)."""
    papers = [f"{g}/index" for g in groups if g not in CORE_GROUP]
    library = [f"{g}/index" for g in groups if g in CORE_GROUP] + (["api/index"] if api else [])
    blocks = [("Results", ["board"]), ("Papers", papers), ("Library", library)]
    return "\n\n".join("\n".join(["```{toctree}", ":hidden:", f":caption: {cap}", ""] + docs + ["```"])
                       for cap, docs in blocks if docs)


# ---------------------------------------------------------------------------------- the board

def load_board(results_dir: Path | None) -> Any | None:
    """The `kimi_papers.core.ledger.Board` of a results folder, or None when no result is recorded yet."""
    from kimi_papers.core.board import board
    from kimi_papers.core.ledger import ledger_dir
    rdir = Path(results_dir) if results_dir else ledger_dir()
    if not sorted(rdir.glob("*.json")):
        return None
    from kimi_papers.core import viz
    viz.setup()  # the collection's plotly theme for the board figure
    b = board(rdir)
    return None if b.empty else b


def board_page(results_dir: Path | None, links: dict[str, str] | None = None) -> str:
    """The reproduction board page (MyST) with the table and the figure."""
    template = (DOCS / "pages" / "board.md").read_text(encoding="utf-8")
    try:
        got = load_board(results_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DocsError(f"reproduction board: {type(e).__name__}: {e}") from e
    if got is None:
        body = "*No results recorded yet: run a notebook with `kimi-papers run SLUG --record`.*"
    else:
        # the chart and the per-paper summary first, then every row
        body = "\n".join(["```{raw} html", got.figure_html(), "```", "", "## Per paper", "", got.summary_markdown(), "",
                           "## Every row", "", "```{raw} html", got.html_tables(links), "```"])
    return template.replace("<!-- BOARD -->", body)


# ------------------------------------------------------------------------------- API reference
# The API pages are rendered by Sphinx itself (autodoc + napoleon, viewcode for [source] links); this
# script only writes one small page per module that points autodoc at it and links its notebook.

def public_names(mod: Any) -> list[str]:
    """The module's public names: its `__all__` (nbdev writes one), else what it defines itself."""
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n, v in vars(mod).items() if not n.startswith("_")
                 and getattr(v, "__module__", None) == mod.__name__ and (inspect.isclass(v) or inspect.isfunction(v))]
    return list(names)


def module_page(mod: Any, notebook_doc: str | None) -> str:
    """One module's API page: a heading, a link to its notebook, and an autodoc directive for its members."""
    lines = [f"# `{mod.__name__}`", ""]
    if notebook_doc:
        lines += [f"Defined, explained and tested in the notebook {{doc}}`/{notebook_doc}`.", ""]
    lines += ["```{eval-rst}", f".. automodule:: {mod.__name__}", "   :members:", "   :member-order: bysource", "```", ""]
    return "\n".join(lines)


_SOURCE_NB = re.compile(r"File to edit:\s*(\S+\.ipynb)")


def module_notebook(mod: Any) -> Path | None:
    """The notebook under nbs/ that nbdev exported the module from (its header says so)."""
    try:
        head = Path(mod.__file__).read_text(encoding="utf-8")[:2000]
    except (OSError, TypeError):
        return None
    m = _SOURCE_NB.search(head)
    if not m:
        return None
    p = (Path(mod.__file__).parent / m.group(1)).resolve()
    try:
        return p.relative_to(NBS.resolve())
    except ValueError:
        return None


def api_modules(package: str = "kimi_papers") -> list[Any]:
    """The package's public modules that define something public, imported (an import error fails)."""
    pkg = importlib.import_module(package)
    names = [package] + [m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")]
    mods = []
    for n in sorted(names):
        if any(part.startswith("_") for part in n.split(".")):
            continue
        try:
            mod = importlib.import_module(n)
        except Exception as e:  # a module that cannot be imported is a broken library: say which
            raise DocsError(f"API docs: importing {n} failed: {type(e).__name__}: {e}") from e
        if public_names(mod):
            mods.append(mod)
    return mods


def write_api(stage_src: Path, site_docs: set[str]) -> bool:
    """api/index.md and one page per module; False when the package has no public module yet."""
    mods = api_modules()
    if not mods:
        return False
    by: dict[str, list[str]] = {}
    for mod in mods:
        nb = module_notebook(mod)
        nb_doc = _doc(nb) if nb is not None and _doc(nb) in site_docs else None
        _write(stage_src / "api" / f"{mod.__name__}.md", module_page(mod, nb_doc))
        parts = mod.__name__.split(".")
        by.setdefault(parts[1] if len(parts) > 2 else "package", []).append(mod.__name__)
    blocks = []
    for g in [g for g in [*CORE_GROUP, *PAPER_GROUPS] if g in by] + sorted(set(by) - set(CORE_GROUP) - set(PAPER_GROUPS)):
        blocks.append("\n".join(["```{toctree}", ":maxdepth: 1", f":caption: {group_title(g) if g != 'package' else 'Package'}", "", *by[g], "```"]))
    page = (DOCS / "pages" / "api.md").read_text(encoding="utf-8").replace("<!-- MODULES -->", "\n\n".join(blocks))
    _write(stage_src / "api" / "index.md", page)
    return True


# ------------------------------------------------------------------------------------ staging

def stage(stage_src: Path, executed: Path | None = None, extra: Iterable[Path] = (),
          results_dir: Path | None = None, api: bool = True, nbs: Path = NBS) -> dict[str, int]:
    """Write the Sphinx sources (processed notebooks and generated pages) into `stage_src`."""
    found = gather(nbs, executed, extra)
    home = found.pop(Path("index.ipynb"), None)
    infos: dict[Path, tuple[str, str]] = {}
    for rel, (src, orig) in found.items():
        nb = proc_notebook(_read_nb(src), fallback_title=rel.stem.replace("_", " "))
        for c in nb["cells"]:
            if c["cell_type"] == "markdown":
                c["source"] = rewrite_repo_links(c["source"], orig.parent, (stage_src / rel).parent, stage_src)
        infos[rel] = describe(nb)
        _write(stage_src / rel, json.dumps(nb, indent=1, ensure_ascii=False))
    groups = _groups(found)
    for g, rels in groups.items():
        _write(stage_src / g / "index.md", group_page(g, rels, infos))
    has_api = api and write_api(stage_src, {_doc(r) for r in found})
    links = {rel.stem: rel.with_suffix(".html").as_posix() for rel in found if len(rel.parts) > 1}
    _write(stage_src / "board.md", board_page(results_dir, links))
    nav = root_toctree(groups, has_api)
    if home is not None:
        nb = proc_notebook(_read_nb(home[0]), fallback_title="kimi_papers")
        for c in nb["cells"]:
            if c["cell_type"] == "markdown":
                c["source"] = rewrite_repo_links(c["source"], nbs, stage_src, stage_src)
        nb["cells"].append({"cell_type": "markdown", "id": "kimi-site-nav", "metadata": {}, "source": nav})
        _write(stage_src / "index.ipynb", json.dumps(nb, indent=1, ensure_ascii=False))
    else:
        _write(stage_src / "index.md", (DOCS / "pages" / "index.md").read_text(encoding="utf-8") + "\n" + nav + "\n")
    return {"notebooks": len(found) + (home is not None), "groups": len(groups)}


# ------------------------------------------------------------------------ remote-reference scan

CDN_HOSTS = ("cdn.jsdelivr.net", "unpkg.com", "cdnjs.cloudflare.com", "cdn.plot.ly", "ajax.googleapis.com",
             "fonts.googleapis.com", "fonts.gstatic.com", "code.jquery.com", "cdn.mathjax.org",
             "stackpath.bootstrapcdn.com", "maxcdn.bootstrapcdn.com", "use.fontawesome.com",
             "kit.fontawesome.com", "esm.sh", "cdn.skypack.dev", "polyfill.io", "requirejs.org")
_REMOTE = re.compile(r"^\s*(?:https?:)?//", re.I)
_CSS_REMOTE = re.compile(r"""(?:url\(\s*['"]?|@import\s+['"])\s*((?:https?:)?//[^'")\s]+)""", re.I)
_SCRIPT_REMOTE = re.compile(r"""['"`]((?:https?:)?//(?:%s)[^'"`\s]*)""" % "|".join(map(re.escape, CDN_HOSTS)), re.I)
_SCRIPT_SRC = re.compile(r"""\.src\s*=\s*['"`]((?:https?:)?//[^'"`\s]+)|import\(\s*['"`]((?:https?:)?//[^'"`\s]+)""", re.I)
GEO_TRACES = {"scattergeo", "choropleth", "scattermapbox", "choroplethmapbox", "densitymapbox", "scattermap",
              "choroplethmap", "densitymap"}
_FETCHING_RELS = {"stylesheet", "icon", "preload", "prefetch", "modulepreload", "manifest", "apple-touch-icon",
                  "mask-icon", "preconnect", "dns-prefetch", "import", "shortcut"}
_FETCH_ATTRS = {"script": ("src",), "img": ("src", "srcset"), "source": ("src", "srcset"), "iframe": ("src",),
                "embed": ("src",), "object": ("data",), "video": ("src", "poster"), "audio": ("src",),
                "track": ("src",), "input": ("src",), "image": ("href", "xlink:href"), "use": ("href", "xlink:href")}


class _RemoteScanner(html.parser.HTMLParser):
    """Collects what a page would fetch from another host (hyperlinks `<a href>` are fine)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        for name in _FETCH_ATTRS.get(tag, ()):
            for url in re.split(r",\s*", a.get(name, "")):
                if url and _REMOTE.match(url):
                    self.found.append(f"<{tag} {name}={url.split()[0]!r}>")
        if tag == "link" and _REMOTE.match(a.get("href", "")) and \
                (_FETCHING_RELS & set(a.get("rel", "").lower().split()) or "as" in a):
            self.found.append(f"<link rel={a.get('rel')!r} href={a['href']!r}>")
        for m in _CSS_REMOTE.finditer(a.get("style", "")):
            self.found.append(f"<{tag} style=... url {m.group(1)!r}>")
        self._in = tag if tag in ("script", "style") else None

    def handle_endtag(self, tag: str) -> None:
        self._in = None

    def handle_data(self, data: str) -> None:
        if self._in == "style":
            self.found += [f"<style> {m.group(1)!r}" for m in _CSS_REMOTE.finditer(data)]
        elif self._in == "script":
            self.found += [f"<script> loads {m.group(1)!r}" for m in _SCRIPT_REMOTE.finditer(data)]
            self.found += [f"<script> loads {(m.group(1) or m.group(2))!r}" for m in _SCRIPT_SRC.finditer(data)]
            self.found += [f"<script> plotly {t!r} trace (its map data comes from a CDN)"
                           for t in sorted(plotly_trace_types(data) & GEO_TRACES)]


def plotly_trace_types(script: str) -> set[str]:
    """Trace types a `Plotly.newPlot(id, data, ...)` call draws (the template's defaults do not count)."""
    dec, types = json.JSONDecoder(), set()
    for m in re.finditer(r"Plotly\.newPlot\(\s*", script):
        try:
            _, i = dec.raw_decode(script, m.end())
            i = re.compile(r"\s*,\s*").match(script, i).end()
            data, _ = dec.raw_decode(script, i)
        except (ValueError, AttributeError):
            continue
        types |= {t.get("type", "scatter") for t in data if isinstance(t, dict)}
    return types


def scan_html(text: str) -> list[str]:
    """Remote scripts, stylesheets, fonts and images that one HTML page references."""
    p = _RemoteScanner()
    p.feed(text)
    p.close()
    return p.found


def find_remote_refs(site: Path) -> list[str]:
    """Every remote reference in the built site's pages and stylesheets, as `file: what`."""
    out = []
    for f in sorted(site.rglob("*.html")):
        out += [f"{f.relative_to(site)}: {r}" for r in scan_html(f.read_text(encoding="utf-8", errors="replace"))]
    for f in sorted(site.rglob("*.css")):
        text = f.read_text(encoding="utf-8", errors="replace")
        out += [f"{f.relative_to(site)}: css {m.group(1)!r}" for m in _CSS_REMOTE.finditer(text)]
    return out


# ------------------------------------------------------------------------------------- build

def sphinx(src: Path, out: Path, doctrees: Path, jobs: str = "1") -> None:
    """`sphinx-build -W --keep-going` (a warning fails the build) with the config in docs/, in-process."""
    from sphinx.cmd.build import build_main
    args = ["-W", "--keep-going", "-q", "-b", "html", "-c", str(DOCS), "-d", str(doctrees), "-j", jobs,
            str(src), str(out)]
    log = io.StringIO()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        rc = build_main(args)
    if rc != 0:
        text = log.getvalue().replace(f"{src}{os.sep}", "")
        raise DocsError(f"sphinx-build failed (exit {rc}); warnings are errors here:\n{text[-12000:]}\n"
                        "(paths are the notebooks' places under nbs/ (or --executed/--extra); in `x.ipynb:N`, "
                        "N // 10000 is the cell's position, counting from 1, among the cells the page shows)")


def build(out: Path, executed: Path | None = None, extra: Iterable[Path] = (), results_dir: Path | None = None,
          keep_src: Path | None = None, jobs: str = "1", api: bool = True, nbs: Path = NBS) -> dict[str, Any]:
    """Stage, build, scan and atomically publish the site into `out`; returns a summary."""
    t0 = time.perf_counter()
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".docs-build-", dir=out.parent))
    try:
        src = keep_src.resolve() if keep_src else work / "src"
        if keep_src and src.exists():
            shutil.rmtree(src)
        if not nbs.is_dir():
            raise DocsError(f"--nbs {nbs}: expected the notebooks folder")
        counts = stage(src, executed, extra, results_dir, api, nbs.resolve())
        t_stage = time.perf_counter() - t0
        sphinx(src, work / "html", work / "doctrees", jobs)
        bad = find_remote_refs(work / "html")
        if bad:
            raise DocsError("pages reference remote resources (the site must work offline):\n  " + "\n  ".join(bad))
        old = work / "previous"
        if out.exists():
            out.rename(old)
        try:
            (work / "html").rename(out)
        except OSError:
            if old.exists():
                old.rename(out)  # put the previous site back
            raise
        pages = sum(1 for _ in out.rglob("*.html"))
        return {**counts, "pages": pages, "stage_s": round(t_stage, 1),
                "total_s": round(time.perf_counter() - t0, 1), "out": str(out)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--executed", type=Path, help="folder of executed notebooks (runs/<ts>/) that replace nbs/ copies")
    ap.add_argument("--extra", type=Path, action="append", default=[], help="extra folder of notebooks (tests)")
    ap.add_argument("--out", type=Path, default=ROOT / "_docs", help="output folder (default _docs/)")
    ap.add_argument("--results", type=Path, help="results folder for the board (default: settings.ini)")
    ap.add_argument("--keep-src", type=Path, help="stage the Sphinx sources here and keep them (debugging)")
    ap.add_argument("--jobs", default="1", help="sphinx-build -j (default 1)")
    ap.add_argument("--no-api", action="store_true", help="skip the API pages (faster; tests)")
    ap.add_argument("--nbs", type=Path, default=NBS, help="notebooks folder (default nbs/; tests use a fixture)")
    a = ap.parse_args(argv)
    # a terminated build still removes its temporary folder (the `finally` in build() runs)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        s = build(a.out, a.executed, a.extra, a.results, a.keep_src, a.jobs, api=not a.no_api, nbs=a.nbs)
    except DocsError as e:
        print(f"build_docs: error: {e}", file=sys.stderr)
        return 1
    print(f"docs: {s['pages']} pages from {s['notebooks']} notebooks in {s['total_s']} s "
          f"(staging {s['stage_s']} s) -> {s['out']}/index.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
