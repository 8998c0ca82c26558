"""Typed settings: one frozen dataclass per section of a preset, built once per
command from the validated config (`Settings.of(cfg)`), so that stage code reads
`s.eval.temperature` rather than `cfg["eval"]["temperature"]`.

The schema (workflow/schemas/config.schema.yaml) stays the source of truth: it
validates presets, fills their defaults, and Snakemake and the docs read it.
Every field here is a key of its section with the schema's type
(tests/test_settings.py); numbers are floats and integers ints, whatever the YAML
wrote. Lists and maps are the config's own (read them, never change them). A
field without a default here has one in the schema, or the schema requires it;
the few defaults here are for keys the schema leaves optional without a default.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from .errors import DeepSpecError


class Section:
    """A section's typed view: `of(mapping)` takes exactly the dataclass's fields."""

    @classmethod
    def of(cls, raw: Mapping, where: str = ""):
        where = where or cls.SECTION
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise DeepSpecError(f"{where}.{unknown[0]}: not a setting of {cls.__name__} (settings.py lags the schema)")
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in raw:
                values[f.name] = _typed(raw[f.name], hints[f.name])
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise DeepSpecError(f"{where}.{f.name}: missing (a config that did not come from config.load_config?)")
        return cls(**values)

    @classmethod
    def view(cls, section_or_mapping):
        """The section as it is, or built from its config mapping."""
        return section_or_mapping if isinstance(section_or_mapping, cls) else cls.of(section_or_mapping)


def _typed(value, hint):
    """A schema "number" given as an integer becomes a float; nothing else changes."""
    if hint is float or hint == Optional[float] or hint == Union[float, Mapping]:
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
    return value


@dataclass(frozen=True)
class Target(Section):
    SECTION: typing.ClassVar[str] = "target"
    name: str
    spec: str
    feature_layers: list
    dtype: str
    device: str
    cpu_matmul: str
    revision: Optional[str] = None
    paper_name: Optional[str] = None


@dataclass(frozen=True)
class Data(Section):
    SECTION: typing.ClassVar[str] = "data"
    root: str
    seed: int
    train: list
    benchmarks: Mapping
    sources: Mapping
    max_prompt_tokens: int
    max_length: int
    min_loss_tokens: int
    system_prompt: Optional[str] = None


@dataclass(frozen=True)
class Regenerate(Section):
    SECTION: typing.ClassVar[str] = "regenerate"
    backend: str
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int
    batch_size: int
    shards: int
    urls: list
    connect_timeout_s: float
    concurrency: int
    request_timeout_s: float
    max_retries: int
    retry_backoff_s: float
    max_failed_fraction: float
    seed: int
    precision: str
    server: Optional[Mapping] = None
    model_name: Optional[str] = None


@dataclass(frozen=True)
class Cache(Section):
    SECTION: typing.ClassVar[str] = "cache"
    mode: str
    dtype: str
    shard_tokens: int
    batch_size: int
    precision: str


@dataclass(frozen=True)
class Drafter(Section):
    SECTION: typing.ClassVar[str] = "drafter"
    block_size: int
    ttt_length: int
    num_layers: Mapping
    markov_rank: int
    markov_head_type: str
    confidence_head: bool
    confidence_with_markov: bool
    init_from_target: bool
    layer_arch: Any  # "target", "qwen3", or a map of layer settings (schema)
    draft_vocab_size: Optional[int] = None
    mask_token_id: Optional[int] = None


@dataclass(frozen=True)
class Loss(Section):
    SECTION: typing.ClassVar[str] = "loss"
    ce_alpha: float
    l1_alpha: float
    conf_alpha: float
    decay_gamma: float
    eagle3_step_decay: float
    eagle3_row_mask: str
    eagle3_normalizer: str


@dataclass(frozen=True)
class Train(Section):
    SECTION: typing.ClassVar[str] = "train"
    methods: list
    lr: Union[float, Mapping]  # one rate, or one per method
    weight_decay: float
    warmup_ratio: float
    grad_clip: float
    global_batch: int
    micro_batch: int
    epochs: float
    num_anchors: int
    chain_rows: int
    chunk_positions: int
    seed: int
    checkpoint_every: int
    log_every: int
    shard_optimizer: bool
    gpus: int
    processes: int
    nodes: int
    main_process_port: int
    precision: str
    start_first: list
    keep_checkpoints: Optional[int]  # keep the newest N regular checkpoints; None keeps all
    max_steps: Any = None  # None, a number of updates, or one per method (schema)
    checkpoint_minutes: Optional[float] = None  # also checkpoint after this many minutes; None: steps only


@dataclass(frozen=True)
class Eval(Section):
    SECTION: typing.ClassVar[str] = "eval"
    temperature: float
    max_new_tokens: int
    seed: int
    confidence_threshold: float
    baselines: list
    prompt_lookup_num_tokens: int
    baseline_jobs: int
    n_boot: int
    batch_size: int
    dtype: str
    precision: str
    speed_prompts: int
    speed_alg1: bool
    gpus: int
    released_checkpoints: Mapping
    kv_budget_gb: Optional[float] = None
    speed_benchmarks: Optional[list] = None


@dataclass(frozen=True)
class Serve(Section):
    SECTION: typing.ClassVar[str] = "serve"
    greedy_prompts: int
    kv_cache_gb: int
    engine: Optional[str] = None
    vllm_python: Optional[str] = None


@dataclass(frozen=True)
class Throughput(Section):
    SECTION: typing.ClassVar[str] = "throughput"
    method: str
    concurrency: list
    requests: int
    max_new_tokens: int
    policies: list
    thresholds: list
    sps_context: int
    sps_csv: Optional[str] = None


@dataclass(frozen=True)
class Ablations(Section):
    SECTION: typing.ClassVar[str] = "ablations"
    depths: list
    block_sizes: list
    thresholds: list
    calibration_benchmark: str


@dataclass(frozen=True)
class Plan(Section):
    SECTION: typing.ClassVar[str] = "plan"
    gpu_tflops: float
    gpu_memory_gib: float
    mfu: float
    gpu_memory_bandwidth_gbs: float
    decode_bandwidth_efficiency: float
    decode_layer_overhead_ms: float
    regenerate_mfu: float
    train_prompts: Optional[int] = None
    prompt_tokens: Optional[float] = None
    answer_tokens: Optional[float] = None
    gpus: Optional[int] = None
    eval_rounds_per_s: Optional[float] = None


SECTIONS = {c.SECTION: c for c in (Target, Data, Regenerate, Cache, Drafter, Loss, Train, Eval, Serve, Throughput,
                                   Ablations, Plan)}


@dataclass(frozen=True)
class Settings:
    """A preset's settings, typed: one attribute per section (`s.eval`, `s.train`,
    ...), plus the run's name and folders. `raw` is the validated config itself,
    for what is defined on it: paths (`RunPaths.of`), rule settings and their
    fingerprints (`config.rule_settings`)."""

    preset: str
    results_dir: str
    figures_dir: str
    resources_dir: str
    logs_dir: str
    target: Target
    data: Data
    regenerate: Regenerate
    cache: Cache
    drafter: Drafter
    loss: Loss
    train: Train
    eval: Eval
    serve: Serve
    throughput: Throughput
    ablations: Ablations
    plan: Plan
    resources: Mapping = field(default_factory=dict)
    description: str = ""
    raw: Mapping = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, cfg: Mapping) -> "Settings":
        """The typed view of a validated config (`config.load_config`)."""
        sections = {name: section.of(cfg.get(name, {})) for name, section in SECTIONS.items()}
        return cls(preset=cfg.get("preset", ""), results_dir=cfg["results_dir"], figures_dir=cfg["figures_dir"],
                   resources_dir=cfg["resources_dir"], logs_dir=cfg["logs_dir"], resources=cfg.get("resources", {}),
                   description=cfg.get("description", ""), raw=cfg, **sections)

    def as_written(self, section: str, key: str):
        """A value as the preset wrote it (1 stays 1, not the typed 1.0): for the
        records and tables that have always printed it so."""
        return self.raw[section][key]

    @classmethod
    def view(cls, cfg_or_settings) -> "Settings":
        """Settings as they are, or built from a validated config: for the entry
        points that callers reach with either."""
        return cfg_or_settings if isinstance(cfg_or_settings, Settings) else cls.of(cfg_or_settings)
