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
    assert set(report["checks"]) == {"bf16_training", "flex_attention", "verify_chi2", "greedy_equal", "varying_flex",
                                     "online_batch", "engine_batch32", "gemma4", "paper_dims", "plan"}
    assert report["checks"]["varying_flex"]["shapes"] >= 3 and report["checks"]["engine_batch32"]["rows"] == 32
    assert report["checks"]["plan"]["plan_total_steps"] > 0 and report["checks"]["paper_dims"]["dspark_step_s"] > 0
    assert (tmp_path / "device_check.md").read_text().startswith("# Device check")


def test_prepare_downloads_cp312_wheels_of_what_the_gpu_image_lacks(tmp_path):
    """--prepare asks pip (here a stand-in that records its arguments: no network) for CPython 3.12 manylinux
    wheels, without dependencies, of jsonschema and everything it needs beyond the GPU image (attrs is there)."""
    log = tmp_path / "args"
    fake = tmp_path / "pip"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {log}\n')
    fake.chmod(0o755)
    dest = tmp_path / "wheels"
    r = subprocess.run(["bash", str(REPO / "benchmarks" / "device_check.sh"), "--prepare", str(dest)],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "DEVICE_CHECK_PIP": str(fake)})
    assert r.returncode == 0, r.stderr
    args = log.read_text().split("\n")
    assert args[0] == "download" and {"--no-deps", "--only-binary=:all:"} <= set(args)
    assert args[args.index("--python-version") + 1] == "3.12" and args[args.index("--implementation") + 1] == "cp"
    assert args[args.index("-d") + 1] == str(dest) and dest.is_dir()
    assert "manylinux2014_x86_64" in args
    pinned = {a.split("==")[0] for a in args if "==" in a}
    assert pinned == {"jsonschema", "jsonschema-specifications", "referencing", "rpds-py"}
