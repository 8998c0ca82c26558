"""REPORT.md's "Served in vLLM" section, from the serve-check records
(results/<target>/serve/<method>.json, `deepspec serve-check`)."""
from __future__ import annotations

from ..files import read_json
from ..paths import RunPaths
from ..settings import Settings


def served_markdown(cfg) -> list[str]:
    """REPORT.md's "Served in vLLM" section from the serve-check records that exist
    (results/<target>/serve/<method>.json): the greedy checks, and tau in vLLM beside
    ours on the same prompts at the evaluation temperature. `cfg`: a config or its Settings."""
    st = Settings.view(cfg)
    paths = RunPaths.of(st)
    recs = {m: read_json(paths.serve_check(m)) for m in st.train.methods if paths.serve_check(m).exists()}
    if not recs:
        return []
    yes = {True: "yes", False: "**no**"}
    lines = ["## Served in vLLM", "",
             *([f"**The serve check failed for {', '.join(m for m, r in recs.items() if not r['passed'])}**: "
                "see results/<target>/serve/<method>.json.", ""] if not all(r["passed"] for r in recs.values()) else []),
             "Each drafter exported as vLLM loads it (`python -m deepspec serve-check`, docs/GPU.md) and decoded by "
             "vLLM one request at a time. Greedy: vLLM's speculative output against the target's own, and every "
             "round's emitted and accepted tokens against ours (in a request's final round vLLM also counts drafts "
             "accepted after the EOS that ended it: the EOS rounds). At the evaluation temperature: τ = 1 + accepted "
             "drafts / rounds on both sides (vLLM's definition), ours from the evaluation's records.", "",
             "| drafter | vLLM | lossless (prompts) | rounds identical (rounds, EOS rounds) | T | τ ours | τ in vLLM "
             "| per-position rates agree |", "|---|---|---|---|---|---|---|---|"]
    for m, r in recs.items():
        g, s = r["greedy"], r.get("sampled") or {}
        tau = (lambda x: "" if x is None else f"{x:.3f}")
        lines.append(f"| {m} | {r['vllm_version']} | {yes[g['lossless']]} ({g['prompts']}) | "
                     f"{yes[g['rounds_identical']]} ({g['rounds']}, {g['eos_rounds']}) | {s.get('temperature', '')} | "
                     f"{tau(s.get('tau_deepspec'))} | {tau(s.get('tau_vllm'))} | "
                     f"{yes[s['agree']] if s.get('agree') is not None else 'n/a'} |")
    for m, r in recs.items():
        cuts = r["greedy"].get("near_tie_cuts") or []
        if cuts:
            lines += ["", f"{m}: {len(cuts)} greedy output(s) first differ where the target's own top two logits are "
                      "within the dtype's near-tie bound (two engines' kernels may pick either token there); those "
                      "outputs are compared up to that position only: " + ", ".join(
                          f"prompt {c['prompt']} ({c['who']}) at token {c['first_difference']}" for c in cuts[:5]) + "."]
    patches = sorted({x for r in recs.values() for x in r.get("vllm_patches", [])})
    if patches:
        lines += ["", "vLLM was patched in the checking process (deepspec/serving/engine_side/decode.py `fix_cpu_expand`): "
                  + "; ".join(patches) + "."]
    for m, r in recs.items():
        by = (r.get("sampled") or {}).get("benchmarks") or {}
        if by:
            lines += ["", f"τ per benchmark, {m} (ours / in vLLM): " + ", ".join(
                f"{b} {v['tau_deepspec']:.3f} / {v['tau_vllm']:.3f}" for b, v in by.items()
                if v["tau_deepspec"] is not None and v["tau_vllm"] is not None) + "."]
    return lines + [""]
