"""The recorded ledger obeys the verdict rules: every row has an interval and n, a role, and the status its interval, gates
and null arms imply (recomputed here, not trusted); no claim or control is decisive with n = 1."""
import json
import subprocess
import sys
from pathlib import Path

from kimi_papers.core.ledger import check_results, role_of

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "data" / "results"


def test_recorded_ledger_statuses_follow_from_intervals():
    problems = check_results(RESULTS)
    assert not problems, "\n".join(problems)


def test_every_claim_has_interval_and_n():
    for p in sorted(RESULTS.glob("*.json")):
        for cid, item in json.loads(p.read_text())["claims"].items():
            for prof, run in item["runs"].items():
                assert {"estimate", "ci", "n", "method", "status"} <= set(run), f"{p.name}:{cid}[{prof}]"
                if role_of(item) != "mechanics" and run["n"] < 2:
                    assert run["status"] == "inconclusive", f"{p.name}:{cid}[{prof}] decisive with n = 1"


def test_check_script_fails_on_a_tampered_status(tmp_path):
    src = next(iter(sorted(RESULTS.glob("*.json"))), None)
    assert src is not None, "no recorded results"
    data = json.loads(src.read_text())
    flip = {"reproduced": "not reproduced", "not reproduced": "reproduced", "inconclusive": "reproduced",
            "holds": "violated", "violated": "holds"}
    cid, item = next((c, i) for c, i in data["claims"].items()
                     if any(not str(r.get("reason", "")).startswith("untestable:") for r in i["runs"].values()))
    prof = next(p for p, r in item["runs"].items() if not str(r.get("reason", "")).startswith("untestable:"))
    item["runs"][prof]["status"] = flip[item["runs"][prof]["status"]]
    (tmp_path / src.name).write_text(json.dumps(data))
    out = subprocess.run([sys.executable, str(ROOT / "CI" / "check_ledger.py"), str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1 and cid in out.stderr, out.stderr


def test_every_row_has_a_role():
    for p in sorted(RESULTS.glob("*.json")):
        for cid, item in json.loads(p.read_text())["claims"].items():
            assert item.get("role") in ("claim", "control", "precondition", "mechanics"), f"{p.name}:{cid}: role {item.get('role')!r}"
