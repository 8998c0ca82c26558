"""The case loop the engine-side checks share (loadcheck.py, sglang_loadcheck.py):
run by path beside them with the engine's python, so it imports only the standard
library."""
from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Callable


def run_cases(request: dict, result_path: str, check: Callable[[dict], dict], results: dict | None = None) -> int:
    """check(case) for every case of `request`; a case that raises is reported as its
    error and traceback (the test names it). Writes {name: result} (after `results`'
    entries) to result_path as JSON."""
    results = dict(results or {})
    for case in request["cases"]:
        try:
            results[case["name"]] = check(case)
        except Exception as e:
            results[case["name"]] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    Path(result_path).write_text(json.dumps(results, indent=2, default=str))
    return 0
