"""The end-to-end tier: the paper presets' CPU rehearsals, whole DAG (python -m pytest -m e2e)."""
import json
import os
import socket
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from deepspec.config import load_config

from helpers import REHEARSALS, copy_workflow, gemma4_reference_config, reference_config, snakemake, write_reference

pytestmark = pytest.mark.e2e


def _released_checkpoint(cfg, method: str, out: Path) -> Path:
    """A synthetic checkpoint in DeepSeek's released layout for the preset's target
    (the prepared tiny target is deterministic: the DAG prepares the same one)."""
    import torch

    from deepspec.drafters import build_drafter
    from deepspec.targets.loading import load_target, prepare_target

    spec = cfg["target"]["spec"]
    target = load_target(spec, path=prepare_target(spec, out.parent / "target"))
    # the SmolLM2 tokenizer: ChatML (Qwen3's template without the thinking block), the mask token unused in text
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "hi"}]
    assert target.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert target.tokenizer.convert_ids_to_tokens(cfg["drafter"]["mask_token_id"]) == "<empty_output>"
    torch.manual_seed(0)
    d = build_drafter(method, target, cfg).eval()
    gemma4 = target.config.get_text_config().model_type.startswith("gemma4")
    ref = gemma4_reference_config(d, target, "per_layer") if gemma4 else reference_config(d, target)
    ref["mask_token_id"] = cfg["drafter"]["mask_token_id"]
    return write_reference(d, target, out, config=ref, shards=2)


@pytest.mark.parametrize("rehearsal", sorted(REHEARSALS))
def test_rehearsal_end_to_end(tmp_path, shared_data, rehearsal):
    """The whole DAG (figures/fig2.pdf) on the rehearsal preset: online features,
    two training processes, the released-layout checkpoint converted and evaluated
    beside the trained drafters; then `plan` on the same preset, whose online
    target forwards are the ones the run counted."""
    # DFlash from a synthetic checkpoint in DeepSeek's released layout, beside the trained Eagle3 and DSpark
    released = {"dflash": f"released/dflash_{rehearsal.replace('-', '_')}_block7"}
    cfg = load_config(rehearsal, {"data": {"root": str(shared_data)}, "eval": {"released_checkpoints": released}})
    for method, rel in released.items():
        _released_checkpoint(cfg, method, tmp_path / rel)
    copy_workflow(tmp_path)
    env = dict(os.environ, DEEPSPEC_DATA=str(shared_data), HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    with socket.socket() as s:  # a free port for the regeneration server (execution only: plan ignores it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = snakemake(tmp_path, "figures/fig2.pdf", "--cores", "2", "--config", f"preset={rehearsal}",
                   f"regenerate={{server: {{port: {port}}}}}", f"eval={{released_checkpoints: {released}}}".replace("'", ""),
                   env=env, timeout=900)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"{rehearsal}: DAG in {wall:.0f} s")
    res = tmp_path / "results"
    name = cfg["target"]["name"]
    # regenerated through the server the DAG started and stopped
    served = (tmp_path / "logs" / name / "regenerate_server.log").read_text()
    recs = (res / name / "regen" / "conversations.jsonl").read_text().splitlines()
    assert len(recs) == sum(e["cap"] for e in cfg["data"]["train"]) and "Terminating service job" in r.stdout + r.stderr
    assert served.count('"POST /v1/chat/completions HTTP/1.1" 200') >= len(recs)
    # two training processes (torchrun, gloo) for each trained method
    for method in set(cfg["train"]["methods"]) - set(released):
        assert "= 2 processes x" in (tmp_path / "logs" / name / f"train_{method}.log").read_text()
    t1 = pd.read_csv(res / "tables" / "table1.csv")
    drafts = t1[t1.method.isin(cfg["train"]["methods"])]
    assert set(drafts.method) == set(cfg["train"]["methods"]) and set(drafts.benchmark) == set(cfg["data"]["benchmarks"])
    assert (drafts.tau >= 1).all()
    for method in cfg["train"]["methods"]:
        summary = json.loads((res / name / "eval" / method / "gsm8k.json").read_text())
        if method in released:  # converted once into resources/drafters/<target>/<checkpoint name>
            assert summary["drafter"].endswith(str(Path("drafters") / name / Path(released[method]).name))
        else:  # trained by the DAG
            assert Path(summary["drafter"]) == Path("results") / name / "drafters" / method
            assert (tmp_path / summary["drafter"] / "config.json").exists()
    # `plan` on the same preset
    out = tmp_path / "plan.json"
    p = _run_deepspec(tmp_path, env, "plan", "--preset", rehearsal, "--offline", "--out", str(out),
                      "--set", f"eval.released_checkpoints.dflash={released['dflash']}")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    plan = json.loads(out.read_text())["training"]["methods"]
    for method in set(cfg["train"]["methods"]) - set(released):  # the online cost plan predicts is what the run made
        summary = json.loads((res / name / "drafters" / method / "train_summary.json").read_text())
        assert summary["online_target_forwards"] > 0
        assert plan[method]["online_target_forwards"] == summary["online_target_forwards"], method


def _run_deepspec(cwd, env, *args):
    import subprocess

    return subprocess.run([sys.executable, "-m", "deepspec", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
