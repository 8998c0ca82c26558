"""The run layout (deepspec/paths.py) that the rules and the commands share."""
from pathlib import Path

from deepspec.config import load_config
from deepspec.paths import RunPaths


def test_logs_and_flags_of_job_families():
    """A job family's logs (one per file: prepare_data) sit in a folder named after
    the job; a job's benchmark beside its log; each baseline job its flag file."""
    paths = RunPaths.of(load_config("tiny"))
    assert paths.log("report") == Path("logs/tiny/report.log")
    assert paths.log("prepare_data", "eval/gsm8k.jsonl") == Path("logs/tiny/prepare_data/eval/gsm8k.jsonl.log")
    assert paths.job_benchmark("train_{method}") == Path("logs/tiny/train_{method}.benchmark.tsv")
    assert paths.baseline_part(1, 2) == Path("results/tiny/eval/baseline/part.1-of-2.done")
    assert paths.baseline_part(0, 1).parent == paths.baseline("gsm8k").parent == paths.baseline_dir()
    assert paths.server_status().parent == paths.server_service().parent == paths.conversations().parent
