"""The prepared GPU check runs in its CPU mode (how CI keeps it from rotting)."""
import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_device_check_cpu_small(tmp_path):
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "device_check.sh"), str(tmp_path), "--cpu", "--small"],
                       capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "device_check.json").read_text())
    failed = {k: v.get("error") for k, v in report["checks"].items() if not v["ok"]}
    assert r.returncode == 0 and not failed, (failed, r.stdout[-2000:], r.stderr[-2000:])
    assert set(report["checks"]) == {"bf16_training", "flex_attention", "verify_chi2", "greedy_equal", "paper_dims", "plan"}
    assert report["checks"]["plan"]["plan_total_steps"] > 0 and report["checks"]["paper_dims"]["dspark_step_s"] > 0
    assert (tmp_path / "device_check.md").read_text().startswith("# Device check")
