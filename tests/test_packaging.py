"""What `pip install -e ".[all]"` installs covers what `make setup` (requirements.txt) installs, pins included."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _requirements() -> dict:
    lines = [l.split("#")[0].strip() for l in (ROOT / "requirements.txt").read_text().splitlines()]
    return {_name(l): l for l in lines if l}


def _project() -> dict:
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(proj["dependencies"])
    for name, extra in proj["optional-dependencies"].items():
        reqs += [r for r in extra if not r.startswith("kimi_papers[")]
    return {_name(r): r.split("#")[0].strip() for r in reqs}


def test_all_extra_covers_requirements_with_the_same_pins():
    req, proj = _requirements(), _project()
    missing = sorted(set(req) - set(proj))
    assert not missing, f"in requirements.txt but in no dependency or extra of pyproject.toml: {missing}"
    pinned = {n: r for n, r in req.items() if "==" in r}
    differ = {n: (r, proj[n]) for n, r in pinned.items() if proj[n].replace(" ", "") != r.replace(" ", "")}
    assert not differ, differ


def test_all_names_every_extra():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    inner = re.fullmatch(r"kimi_papers\[(.*)\]", proj["all"][0]).group(1).split(",")
    assert sorted(inner) == sorted(k for k in proj if k != "all")
