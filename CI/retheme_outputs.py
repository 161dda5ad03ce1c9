"""Re-draw the plotly outputs stored in committed notebooks with the collection's current theme (core.viz's template):
the figure's data and its own layout are kept; only the embedded template (legend placement, tick format) and the HTML
fragment drawn from it are renewed. Run after a theme change instead of re-running every recorded full profile.

    python CI/retheme_outputs.py [NOTEBOOK ...]   (default: every notebook under nbs/)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import plotly.io as pio

from kimi_papers.core import viz
from kimi_papers.core.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
PLOTLY = "application/vnd.plotly.v1+json"


def retheme(path: Path, template: dict) -> int:
    """Renew every stored plotly figure of one notebook in place; returns how many changed."""
    nb = json.loads(path.read_text())
    changed = 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            fig = data.get(PLOTLY)
            if fig is None or fig.get("layout", {}).get("template") == template:
                continue
            fig.setdefault("layout", {})["template"] = template
            if "text/html" in data:
                html = viz.KimiRenderer().to_mimebundle(fig)["text/html"]
                data["text/html"] = html.splitlines(keepends=True) if isinstance(data["text/html"], list) else html
            changed += 1
    if changed:
        atomic_write_text(path, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return changed


def main(argv: list[str]) -> int:
    viz.setup()
    import plotly.graph_objects as go
    template = json.loads(go.Figure(layout=dict(template="kimi")).to_json())["layout"]["template"]
    paths = [Path(a) for a in argv] or sorted((ROOT / "nbs").rglob("*.ipynb"))
    for p in paths:
        n = retheme(p, template)
        if n:
            print(f"{p.relative_to(ROOT) if p.is_absolute() else p}: {n} figure(s) re-themed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
