"""Where every file of a run lives: the one source of truth for the layout.

The deepspec commands take their default paths from here, and
workflow/rules/common.smk builds every rule's inputs and outputs from the same
methods (given wildcard names such as "{method}" they return Snakemake
patterns), then passes `{output}` to the commands. R = results_dir, T = target name:

  resources/targets/T/                 prepared target checkpoint   (prepare_target)
  resources/drafters/T/<name>/         converted released drafters  (convert)
  resources/hub/{datasets,models}/<owner>--<name>@<revision>/  hub snapshots at pinned revisions (fetch_dataset, fetch_released)
  R/T/plan.json                        the run's cost estimate      (python -m deepspec plan)
  R/T/regen/conversations.jsonl        regenerated answers          (regenerate: the merged shards)
  R/T/regen/shards/conversations.I-of-N.jsonl  shard I of regenerate.shards = N  (regenerate_shard)
  R/T/regen/server.{service,pid}       the regeneration server's marker and pid (regenerate_server)
  R/T/cache/manifest.json              target cache                 (build_cache)
  R/T/drafters/<method>/               trained drafter + train_log, tensorboard/  (train)
  R/T/eval/<method>/<benchmark>.csv    per-round records, .json summary      (evaluate)
  R/T/eval/baseline/<benchmark>.json   plain / prompt-lookup tokens/s (+ .csv) (baseline)
  R/T/eval/baseline/part.I-of-N.done   baseline job I of eval.baseline_jobs = N finished (baseline)
  R/T/eval/dspark/<benchmark>.{sweep.csv,calibration.csv,alg1.json}          (schedule)
  R/T/serve/<method>.json, R/T/serve/<method>.vllm/  the drafter served in vLLM, checked (serve_check)
  R/tables/{table1.csv,table1.md,fig2.csv}, figures/fig2.{pdf,png}, R/REPORT.md, R/provenance.json (report)
  R/tables/figN.csv, figures/figN.pdf  ablations                    (fig3 .. fig6)
  L/T/<job>.log                        one log per job, L = logs_dir (L/T/<job>/<sub>.log per file of a
                                       job family, e.g. prepare_data); L/T/<job>.benchmark.tsv its timing
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .settings import Settings


def target_dir(resources: str, name: str) -> Path:
    """A prepared target checkpoint: <resources>/targets/<name>."""
    return Path(resources) / "targets" / name


@dataclass(frozen=True)
class RunPaths:
    results: str = "results"
    figures: str = "figures"
    resources: str = "resources"
    target: str = "{target}"  # the target name (RunPaths.of(cfg) fills it in)
    logs: str = "logs"

    @classmethod
    def of(cls, cfg: Settings | Mapping, target: str | None = None) -> "RunPaths":
        """A run's paths, from its settings (or its validated config)."""
        if isinstance(cfg, Settings):
            return cls(cfg.results_dir, cfg.figures_dir, cfg.resources_dir, target or cfg.target.name, cfg.logs_dir)
        return cls(cfg["results_dir"], cfg["figures_dir"], cfg["resources_dir"], target or cfg["target"]["name"],
                   cfg["logs_dir"])

    @property
    def run(self) -> Path:
        return Path(self.results) / self.target

    # -- resources
    def target_checkpoint(self) -> Path:
        return target_dir(self.resources, self.target)

    def hub_snapshot(self, kind: str, name: str) -> Path:
        """A hub repository at a revision (deepspec/fetch.py): kind datasets or models,
        name <owner>--<name>@<revision>."""
        return Path(self.resources) / "hub" / kind / name

    def converted_drafters(self) -> Path:
        return Path(self.resources) / "drafters" / self.target

    def plan(self) -> Path:
        """`python -m deepspec plan`'s estimate of the run (plan.json)."""
        return self.run / "plan.json"

    # -- data, cache, drafters
    def conversations(self) -> Path:
        return self.run / "regen" / "conversations.jsonl"

    def tokens_record(self) -> Path:
        """Where the tokenize rule records the token arrays of the conversations."""
        return self.run / "regen" / "tokens.json"

    def conversations_shard(self, shard, shards: int) -> Path:
        """Shard `shard` of `shards` (regenerate.shards) of the regenerated conversations."""
        return self.run / "regen" / "shards" / f"conversations.{shard}-of-{shards}.jsonl"

    def server_service(self) -> Path:
        """The regeneration server's service-job marker (Snakemake removes it when the group ends)."""
        return self.run / "regen" / "server.service"

    def server_status(self) -> Path:
        """The regeneration server's status (deepspec/regeneration/supervisor.py: this run's
        token, host, supervisor pid, port, state), which the shards and the merge read."""
        return self.run / "regen" / "server.json"

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

    def serve_check(self, method: str) -> Path:
        """`serve-check`'s record of `method` served in vLLM (its export beside it)."""
        return self.run / "serve" / f"{method}.json"

    def baseline_dir(self) -> Path:
        return self.eval_dir() / "baseline"

    def baseline(self, benchmark: str) -> Path:
        return self.baseline_dir() / f"{benchmark}.json"

    def baseline_part(self, part, parts: int) -> Path:
        """The flag of baseline job `part` of `parts` (eval.baseline_jobs): its benchmarks are timed."""
        return self.baseline_dir() / f"part.{part}-of-{parts}.done"

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

    def provenance(self) -> Path:
        """What the results were made with (deepspec.provenance), written by the report rule."""
        return Path(self.results) / "provenance.json"

    def log(self, job: str, sub: str | None = None) -> Path:
        """L/T/<job>.log, or with `sub` L/T/<job>/<sub>.log (one per file of a job family)."""
        return Path(self.logs) / self.target / (f"{job}/{sub}.log" if sub else f"{job}.log")

    def job_benchmark(self, job: str) -> Path:
        """The job's Snakemake benchmark (wall time, memory): L/T/<job>.benchmark.tsv."""
        return Path(self.logs) / self.target / f"{job}.benchmark.tsv"


# Files beside a regeneration output (conversations.jsonl -> .errors.jsonl, .settings.json).
def errors_path(out: Path) -> Path:
    return out.with_name(out.stem + ".errors.jsonl")


def settings_path(out: Path) -> Path:
    return out.with_name(out.stem + ".settings.json")
