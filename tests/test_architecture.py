"""The shape of the library: import layers and cycles (import-linter), papers apart from one another, and each
paper module the method alone (its experiment in `<slug>_experiment`), with a "Use it on your own" example."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from kimi_papers._nbdev import EXPERIMENT_SUFFIX
from kimi_papers.core.runner import workbooks

ROOT = Path(__file__).resolve().parents[1]
METHOD_LINES = 400  # non-blank lines of a paper's method module (docstrings and comments count)


def _papers() -> list:
    """Paper workbooks (companion notebooks such as mvr_cache_vcache have no 'Results at a glance')."""
    out = []
    for w in workbooks(ROOT):
        if w.is_paper and "board.glance(" in w.path.read_text():
            out.append(w)
    return out


PAPERS = _papers()


def _module(w) -> str:
    return f"kimi_papers.{w.folder}.{w.slug}"


def _lint_imports(cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_paper_list_is_complete():
    assert len(PAPERS) >= 28, [w.slug for w in PAPERS]


def test_import_contracts_hold():
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_import_contracts_fail_on_a_new_cycle(tmp_path):
    """A deliberately added core cycle (config -> board -> ledger -> config) breaks the contract."""
    shutil.copytree(ROOT / "kimi_papers", tmp_path / "kimi_papers", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    cfg = tmp_path / "kimi_papers" / "core" / "config.py"
    cfg.write_text(cfg.read_text() + "\n\ndef _cycle():\n    from kimi_papers.core import board\n    return board\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = _lint_imports(tmp_path, env)
    assert r.returncode != 0 and "kimi_papers.core" in r.stdout and ".config -> .board" in r.stdout.replace(
        "kimi_papers.core", ""), r.stdout[-3000:]


def test_papers_import_only_core_and_their_own_companions():
    graph = grimp.build_graph("kimi_papers")
    papers = {_module(w) for w in PAPERS}
    bad = []
    for mod in sorted(graph.modules):
        parts = mod.split(".")
        if len(parts) != 3 or parts[1] in ("core", "integrations") or parts[1].startswith("_"):
            continue
        own = max((p for p in papers if mod == p or mod.startswith(p + "_")), key=len, default=mod)
        for imp in graph.find_modules_directly_imported_by(mod):
            ip = imp.split(".")
            if ip[0] != "kimi_papers" or ip[1] == "core" or imp == "kimi_papers":
                continue
            if not (imp == own or imp.startswith(own + "_")):
                bad.append(f"{mod} imports {imp}")
    assert not bad, bad


@pytest.mark.parametrize("w", PAPERS, ids=lambda w: w.slug)
def test_method_module_is_the_method(w):
    path = ROOT / "kimi_papers" / w.folder / f"{w.slug}.py"
    lines = [l for l in path.read_text().splitlines() if l.strip()]
    assert len(lines) <= METHOD_LINES, (
        f"{path.name}: {len(lines)} non-blank lines; move the experiment harness to "
        f"{w.slug}{EXPERIMENT_SUFFIX}.py (`#| export {w.folder}.{w.slug}{EXPERIMENT_SUFFIX}`)")


def test_method_modules_import_without_their_experiments():
    """Importing every paper's method module pulls in no experiment module."""
    code = (
        "import importlib, sys, json\n"
        f"mods = {json.dumps([_module(w) for w in PAPERS])}\n"
        "bad = {}\n"
        "for m in mods:\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module(m)\n"
        f"    new = [k for k in set(sys.modules) - before if k.endswith('{EXPERIMENT_SUFFIX}')]\n"
        "    if new: bad[m] = sorted(new)\n"
        "print(json.dumps(bad))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.parametrize("w", PAPERS, ids=lambda w: w.slug)
def test_notebook_has_an_own_data_example(w):
    nb = json.loads(w.path.read_text())
    cells = nb["cells"]
    heads = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
             and re.search(r"^#+\s*Use it on your own", "".join(c["source"]), re.M)]
    assert heads, f"{w.path.name}: no '## Use it on your own ...' section"
    code = [c for c in cells[heads[0] + 1:heads[0] + 4] if c["cell_type"] == "code"]
    assert code and not any("skip" in "".join(c["source"]).splitlines()[0] for c in code[:1] if c["source"]), (
        f"{w.path.name}: the own-data example must be a code cell that the smoke run executes")
