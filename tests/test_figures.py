"""The figures a reader sees in the committed notebooks (and so on the site): each shown once, annotations where their
lines are on log axes, the shared theme's legend outside the plot area."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "nbs").rglob("*.ipynb"))
PLOTLY = "application/vnd.plotly.v1+json"


def _figures(path: Path):
    """(cell index, [plotly figure dicts of that cell]) for every code cell with plotly outputs."""
    nb = json.loads(path.read_text())
    for i, c in enumerate(nb["cells"]):
        figs = [o["data"][PLOTLY] for o in c.get("outputs", []) if PLOTLY in o.get("data", {})]
        if figs:
            yield i, figs


def _log_axes(layout: dict) -> set:
    return {k for k, v in layout.items() if k[:5] in ("xaxis", "yaxis") and isinstance(v, dict) and v.get("type") == "log"}


def annotations_misplaced_on_log_axes(fig: dict) -> list:
    """Annotations in data coordinates of a log axis whose position looks like a data value, not its log10.

    plotly places such an annotation at 10**y: `add_hline(y=0.05, annotation_text=...)` on a log axis draws the text
    at 1.12. Heuristic: the annotation sits on a horizontal/vertical line shape whose position equals the annotation's
    own coordinate (the shape is in data units, so the annotation was given data units too)."""
    lay = fig.get("layout", {})
    logs = _log_axes(lay)
    bad = []
    for a in lay.get("annotations", []):
        for ax in ("x", "y"):
            ref = a.get(f"{ax}ref", "")
            if not ref or "domain" in ref or ref == "paper" or ref.replace(ax, f"{ax}axis", 1) not in logs:
                continue
            pos = a.get(ax)
            lines = [s for s in lay.get("shapes", []) if s.get(f"{ax}ref") == ref and s.get(f"{ax}0") == s.get(f"{ax}1")]
            if any(s.get(f"{ax}0") == pos for s in lines):
                bad.append(f"{a.get('text')!r} at {ax}={pos} (a log axis wants log10)")
    return bad


def test_the_heuristic_catches_a_hline_label_on_a_log_axis():
    plotly = pytest.importorskip("plotly.graph_objects")
    fig = plotly.Figure(plotly.Scatter(x=[1, 2], y=[0.01, 1.0]))
    fig.add_hline(y=0.05, annotation_text="KL = 0.05")
    fig.update_layout(yaxis_type="log")
    assert annotations_misplaced_on_log_axes(json.loads(fig.to_json())) == ["'KL = 0.05' at y=0.05 (a log axis wants log10)"]
    fig.update_layout(yaxis_type="linear")
    assert annotations_misplaced_on_log_axes(json.loads(fig.to_json())) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT / "nbs")))
def test_each_figure_once_and_labels_on_their_lines(path):
    problems = []
    for i, figs in _figures(path):
        texts = [json.dumps(f, sort_keys=True) for f in figs]
        if len(set(texts)) < len(texts):
            problems.append(f"cell {i}: the same figure shown {len(texts) - len(set(texts)) + 1} times")
        for f in figs:
            problems += [f"cell {i}: {b}" for b in annotations_misplaced_on_log_axes(f)]
    assert not problems, problems
