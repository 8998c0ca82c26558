"""Prompts: the training prompts (regenerate rule) and the benchmark prompts
(evaluate rule). Turns-JSONL reading, validation and deterministic subsampling.

A record is ``{"turns": [str, ...], "reference": optional str}``. A malformed
line fails with one error naming file and line. A source ``hub:<dataset id>``
is read through `datasets` from its snapshot at the entry's pinned
``revision`` (deepspec/fetch.py; ShareGPT-style ``conversations`` are mapped
to user turns). A training source ``synthetic:<generator>`` is made here, its
``cap`` prompts drawn with ``data.seed`` (deepspec/data/synthetic.py).
"""
from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional

from ..config import REPO_ROOT
from ..errors import DeepSpecError, first_line
from ..files import iter_jsonl
from ..settings import Settings

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    id: str  # "<source>:<line>" - stable across runs
    turns: list[str]
    reference: Optional[str] = None
    source: str = ""
    meta: dict = field(default_factory=dict)


def data_root(cfg: Settings | Mapping) -> Path:
    """The prompt data directory: $DEEPSPEC_DATA when set, else `data.root`, whose
    relative paths (the default `data`, git-ignored) are under the repository
    (config.REPO_ROOT), wherever the command runs."""
    env = os.environ.get("DEEPSPEC_DATA")
    if env:
        return Path(env)
    root = Path(Settings.view(cfg).data.root)
    return root if root.is_absolute() else REPO_ROOT / root


def is_prompt_file(path: str) -> bool:
    """Whether a source's `path` names a file under data.root (not hub: or synthetic:)."""
    return not path.startswith(("hub:", "synthetic:"))


def synthetic_source(name: str, n: int, seed: int) -> list[Prompt]:
    """The `n` prompts of the generator `name`, ids "<name>:<i>"."""
    from .synthetic import synthetic_prompts

    return [Prompt(id=f"{name}:{i}", turns=[text], source=name, meta={"subject": subject})
            for i, (subject, text) in enumerate(synthetic_prompts(name, n, seed))]


def read_turns_jsonl(path: str | os.PathLike, source: Optional[str] = None) -> list[Prompt]:
    path = Path(path)
    source = source or path.stem
    out = [_validate(rec, where, f"{source}:{lineno}", source) for lineno, where, rec in iter_jsonl(path, "prompt file")]
    if not out:
        raise DeepSpecError(f"{path}: no records")
    return out


def _validate(rec, where: str, pid: str, source: str) -> Prompt:
    if not isinstance(rec, dict):
        raise DeepSpecError(f"{where}: a record must be a JSON object")
    turns = rec.get("turns")
    if turns is None:
        raise DeepSpecError(f"{where}: missing 'turns'")
    if not isinstance(turns, list) or not turns:
        raise DeepSpecError(f"{where}: 'turns' must be a non-empty list of strings")
    for i, t in enumerate(turns):
        if not isinstance(t, str):
            raise DeepSpecError(f"{where}: turn {i} is not a string")
        if not t.strip():
            raise DeepSpecError(f"{where}: turn {i} is empty")
    ref = rec.get("reference")
    if ref is not None and not isinstance(ref, str):
        raise DeepSpecError(f"{where}: 'reference' must be a string")
    return Prompt(id=pid, turns=list(turns), reference=ref, source=source)


def subsample(prompts: list[Prompt], cap: Optional[int], seed: int = 980406) -> list[Prompt]:
    """The reference rule: if there are more rows than the cap, shuffle with
    random.Random(seed) and truncate; otherwise keep the file order."""
    if cap is None or len(prompts) <= cap:
        return list(prompts)
    rows = list(prompts)
    random.Random(seed).shuffle(rows)
    return rows[:cap]


def _read_hub(s: Settings, dataset_id: str, revision: str, split: str) -> list[Prompt]:
    """The dataset's rows from its snapshot at `revision` (deepspec/fetch.py: fetched by
    the DAG's local rule fetch_dataset, or now when a command runs by hand)."""
    from ..fetch import fetched

    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        raise DeepSpecError("reading hub datasets needs the `datasets` package") from None
    local = fetched(s, "dataset", dataset_id, revision)
    try:
        ds = datasets.load_dataset(str(local), split=split)
    except (OSError, ValueError) as e:
        first = first_line(e)
        raise DeepSpecError(f"cannot read {dataset_id}@{revision} ({local}), split {split!r}: {first}") from None
    out = []
    for i, rec in enumerate(ds):
        if "turns" in rec:
            turns = rec["turns"]
        else:
            conv = rec.get("conversations") or rec.get("messages") or []
            turns = [
                m.get("value", m.get("content"))
                for m in conv
                if m.get("from", m.get("role")) in ("human", "user")
            ]
        turns = [t for t in turns if isinstance(t, str) and t.strip()]
        if turns:
            out.append(Prompt(id=f"{dataset_id}:{i}", turns=turns, source=dataset_id))
    return out


def load_sources(s: Settings, entries: Iterable[dict]) -> list[Prompt]:
    """The prompts of the sources `entries` (data.train, or one benchmark), each
    subsampled to its cap. Prompt ids are "<file name stem>:<line>", so two files
    of one name (or one file listed twice) would collide: one line naming the id
    and both sources."""
    root = data_root(s)
    seed = s.data.seed
    out: list[Prompt] = []
    where: dict[str, str] = {}
    for e in entries:
        path = e["path"]
        if path.startswith("hub:"):
            rows = _read_hub(s, path[4:], e["revision"], e.get("split", "train"))
        elif path.startswith("synthetic:"):
            rows = synthetic_source(path[len("synthetic:"):], e["cap"], seed)
        else:
            rows = read_turns_jsonl(root / path)
        for r in subsample(rows, e.get("cap"), seed):
            if r.id in where:
                why = "the source is listed twice" if where[r.id] == path else \
                    "ids are <file name stem>:<line>: rename one of the files"
                raise DeepSpecError(f"duplicate prompt id '{r.id}' in {where[r.id]} and {path} ({why})")
            where[r.id] = path
            out.append(r)
    return out


def load_train_prompts(cfg: Settings | Mapping) -> list[Prompt]:
    s = Settings.view(cfg)
    return load_sources(s, s.data.train)


def load_benchmark(cfg: Settings | Mapping, name: str) -> list[Prompt]:
    s = Settings.view(cfg)
    benches = s.data.benchmarks
    if name not in benches:
        raise DeepSpecError(f"unknown benchmark '{name}' (preset has: {', '.join(benches)})")
    b = benches[name]
    rows = load_sources(s, [b])
    for r in rows:
        r.meta["domain"] = b["domain"]
        r.meta["benchmark"] = name
    return rows


def speed_benchmarks(cfg: Settings | Mapping) -> list[str]:
    """The benchmarks whose first eval.speed_prompts prompts are decoded alone and
    timed (tokens/s, speedup vs plain): eval.speed_benchmarks, or every benchmark
    (none when eval.speed_prompts is 0)."""
    s = Settings.view(cfg)
    if not s.eval.speed_prompts:
        return []
    names, benches = s.eval.speed_benchmarks, s.data.benchmarks
    return list(benches) if names is None else [b for b in benches if b in names]


def check_prompt_length(n_tokens: int, limit: int, where: str) -> None:
    if n_tokens == 0:
        raise DeepSpecError(f"{where}: empty prompt")
    if n_tokens > limit:
        raise DeepSpecError(f"{where}: prompt has {n_tokens} tokens, over the limit of {limit} (data.max_prompt_tokens)")


def benchmark_prompt_set(cfg: Settings | Mapping, target, benchmark: str) -> tuple[list, list[dict]]:
    """(Prompt, token ids) per benchmark prompt: first turn only, the target's chat
    template, no system prompt, non-thinking. Prompts over data.max_prompt_tokens
    are skipped, each named in a warning, and returned as the second value
    ({sample_id, index, tokens}; index in the benchmark's sample), so that every
    rule that reads a benchmark (baseline, evaluate) decodes the same prompts.
    An empty prompt, or a benchmark with every prompt over the limit, is an error."""
    s = Settings.view(cfg)
    limit, kept, skipped = s.data.max_prompt_tokens, [], []
    for i, p in enumerate(load_benchmark(s, benchmark)):
        ids = target.chat_ids([{"role": "user", "content": p.turns[0]}])
        if len(ids) > limit:
            skipped.append({"sample_id": p.id, "index": i, "tokens": len(ids)})
            continue
        check_prompt_length(len(ids), limit, f"{benchmark} prompt {p.id}")
        kept.append((p, ids))
    if skipped:
        log.warning(
            "%s: %d prompt(s) over data.max_prompt_tokens=%d skipped: %s", benchmark, len(skipped), limit,
            ", ".join(f"#{s['index']} {s['sample_id']} ({s['tokens']} tokens)" for s in skipped))
    if not kept:
        first = skipped[0]
        check_prompt_length(first["tokens"], limit, f"{benchmark} prompt {first['sample_id']} (every prompt of "
                                                    f"{benchmark} is over the limit)")
    return kept, skipped


def benchmark_prompt_ids(cfg: Settings | Mapping, target, benchmark: str) -> list:
    """The decoded prompts of `benchmark_prompt_set` (over-long ones skipped with a warning)."""
    return benchmark_prompt_set(cfg, target, benchmark)[0]
