"""Where every file of a run lives: the one source of truth for the layout.

The deepspec commands take their default paths from here, and
workflow/rules/common.smk builds every rule's inputs and outputs from the same
methods (with the target name "{target}" and wildcard names such as
"{method}" they return Snakemake patterns), then passes `{output}` to the
commands. R = results_dir, T = target name:

  resources/targets/T/                 prepared target checkpoint   (prepare_target)
  resources/drafters/T/<name>/         converted released drafters  (convert)
  R/T/plan.json                        the run's cost estimate      (python -m deepspec plan)
  R/T/regen/conversations.jsonl        regenerated answers          (regenerate)
  R/T/cache/manifest.json              target cache                 (build_cache)
  R/T/drafters/<method>/               trained drafter + train_log  (train)
  R/T/eval/<method>/<benchmark>.csv    per-round records, .json summary      (evaluate)
  R/T/eval/baseline/<benchmark>.json   plain / prompt-lookup tokens/s (+ .csv) (baseline)
  R/T/eval/dspark/<benchmark>.{sweep.csv,calibration.csv,alg1.json}          (schedule)
  R/tables/{table1.csv,table1.md,fig2.csv}, figures/fig2.{pdf,png}, R/REPORT.md (report)
  R/tables/figN.csv, figures/figN.pdf  ablations                    (fig3 .. fig6)
  logs/T/<job>.log                     one log per job
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LOGS = "logs"


def target_dir(resources: str, name: str) -> Path:
    """A prepared target checkpoint: <resources>/targets/<name>."""
    return Path(resources) / "targets" / name


@dataclass(frozen=True)
class RunPaths:
    results: str = "results"
    figures: str = "figures"
    resources: str = "resources"
    target: str = "{target}"  # the target name, or the Snakemake wildcard
    logs: str = LOGS

    @classmethod
    def of(cls, cfg: dict, target: str | None = None) -> "RunPaths":
        return cls(cfg["results_dir"], cfg["figures_dir"], cfg["resources_dir"], target or cfg["target"]["name"])

    @property
    def run(self) -> Path:
        return Path(self.results) / self.target

    # -- resources
    def target_checkpoint(self) -> Path:
        return target_dir(self.resources, self.target)

    def converted_drafters(self) -> Path:
        return Path(self.resources) / "drafters" / self.target

    def plan(self) -> Path:
        """`python -m deepspec plan`'s estimate of the run (plan.json)."""
        return self.run / "plan.json"

    # -- data, cache, drafters
    def conversations(self) -> Path:
        return self.run / "regen" / "conversations.jsonl"

    def conversations_shard(self, shard, shards: int) -> Path:
        """Shard `shard` of `shards` of the regenerated conversations (regenerate.shards > 1)."""
        return self.run / "regen" / "shards" / f"conversations.{shard}-of-{shards}.jsonl"

    def cache_dir(self) -> Path:
        return self.run / "cache"

    def drafter_dir(self, method: str) -> Path:
        return self.run / "drafters" / method

    # -- evaluation
    def eval_dir(self) -> Path:
        return self.run / "eval"

    def records(self, method: str, benchmark: str) -> Path:
        return self.eval_dir() / method / f"{benchmark}.csv"

    def summary(self, method: str, benchmark: str) -> Path:
        return self.records(method, benchmark).with_suffix(".json")

    def baseline(self, benchmark: str) -> Path:
        return self.eval_dir() / "baseline" / f"{benchmark}.json"

    def schedule(self, benchmark: str, kind: str, method: str = "dspark") -> Path:
        """kind: sweep.csv, calibration.csv or alg1.json."""
        return self.eval_dir() / method / f"{benchmark}.{kind}"

    # -- tables, figures, report
    def table(self, name: str) -> Path:
        return Path(self.results) / "tables" / name

    def figure(self, name: str) -> Path:
        return Path(self.figures) / name

    def report(self) -> Path:
        return Path(self.results) / "REPORT.md"

    def log(self, job: str) -> Path:
        return Path(self.logs) / self.target / f"{job}.log"


# Files beside a regeneration output (conversations.jsonl -> .errors.jsonl, .settings.json).
def errors_path(out: Path) -> Path:
    return out.with_name(out.stem + ".errors.jsonl")


def settings_path(out: Path) -> Path:
    return out.with_name(out.stem + ".settings.json")
