#!/usr/bin/env python
"""Write README.md from nbs/index.ipynb (what `nbdev-readme` does, without Quarto).

    python CI/sync_readme.py            # rewrite README.md (atomically) if it changed
    python CI/sync_readme.py --check    # exit 1, with a diff, if README.md is out of date

Markdown cells are copied verbatim; `#| hide` / `#| include: false` cells are dropped; a code cell
shows its source (directive lines removed) unless `#| echo: false`, then its outputs: `text/markdown`
verbatim, otherwise plain text or a stream in a fenced block. Figures, HTML-only outputs and widgets
are left out: they do not render in a README. Relative links are rewritten from `nbs/` to the root.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import posixpath
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = "<!-- Generated from nbs/index.ipynb by CI/sync_readme.py: edit the notebook, not this file. -->\n\n"
_DIRECTIVE = re.compile(r"^\s*#\s*\|\s*(.*?)\s*$")
_MD_LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_HTML_LINK = re.compile(r"""((?:src|href)=["'])([^"']+)(["'])""")
_SKIP_MIMES = ("application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json")


def _text(v) -> str:
    return "".join(v) if isinstance(v, list) else (v or "")


def directives(source: str) -> tuple[dict[str, str], str]:
    """Leading `#| key: value` directives of a code cell and the code after them."""
    lines, d, i = source.splitlines(), {}, 0
    while i < len(lines) and (not lines[i].strip() or _DIRECTIVE.match(lines[i])):
        m = _DIRECTIVE.match(lines[i])
        if m and m.group(1):
            key, value = (re.split(r":\s*|\s+", m.group(1), maxsplit=1) + [""])[:2]
            d[key.strip().lower()] = value.lstrip(": ").strip().lower()
        i += 1
    return d, "\n".join(lines[i:]).strip("\n")


def _relink(target: str, base: str = "nbs") -> str:
    """A link written relative to nbs/ made relative to the repository root."""
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target, re.I):
        return target
    return posixpath.normpath(posixpath.join(base, target))


def relink(md: str) -> str:
    md = _MD_LINK.sub(lambda m: m.group(1) + _relink(m.group(2)) + m.group(3), md)
    return _HTML_LINK.sub(lambda m: m.group(1) + _relink(m.group(2)) + m.group(3), md)


def output_md(o: dict) -> str | None:
    """One output as README markdown, or None when a README cannot show it."""
    if o.get("output_type") == "stream":
        text = _text(o.get("text")).rstrip("\n")
        return f"```\n{text}\n```" if text and o.get("name") != "stderr" else None
    if o.get("output_type") == "error":
        return f"```\n{o.get('ename')}: {o.get('evalue')}\n```"
    data = o.get("data") or {}
    if any(m in data for m in _SKIP_MIMES):
        return None
    if "text/markdown" in data:
        return relink(_text(data["text/markdown"]).strip("\n"))
    if "text/plain" in data and not any(k.startswith("image/") or k == "text/html" for k in data):
        return f"```\n{_text(data['text/plain']).rstrip()}\n```"
    if "text/plain" in data and "text/html" in data and "<table" in _text(data["text/html"]):
        return f"```\n{_text(data['text/plain']).rstrip()}\n```"  # a DataFrame: its text table reads fine
    return None


def readme_from_notebook(nb: dict) -> str:
    """README text for an index notebook."""
    parts: list[str] = []
    for c in nb.get("cells", []):
        src = _text(c.get("source"))
        if c.get("cell_type") == "markdown":
            parts.append(relink(src.strip("\n")))
        elif c.get("cell_type") == "code":
            d, body = directives(src)
            if "hide" in d or d.get("include") == "false":
                continue
            if body and d.get("echo") != "false":
                parts.append(f"```python\n{body}\n```")
            if d.get("output") != "false":
                parts += [m for o in c.get("outputs", []) if (m := output_md(o))]
    return HEADER + "\n\n".join(p for p in parts if p.strip()) + "\n"


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write README.md from nbs/index.ipynb.")
    ap.add_argument("--check", action="store_true", help="only check; exit 1 with a diff if README.md is stale")
    ap.add_argument("--notebook", type=Path, default=ROOT / "nbs" / "index.ipynb")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    a = ap.parse_args(argv)
    try:
        nb = json.loads(a.notebook.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        print(f"sync_readme: error: cannot read {a.notebook}: {e}", file=sys.stderr)
        return 1
    new = readme_from_notebook(nb)
    old = a.readme.read_text(encoding="utf-8") if a.readme.exists() else ""
    if new == old:
        return 0
    if a.check:
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                   str(a.readme), "from " + str(a.notebook)))
        print(f"sync_readme: {a.readme} is out of date: run python CI/sync_readme.py", file=sys.stderr)
        return 1
    write_atomic(a.readme, new)
    print(f"sync_readme: wrote {a.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
