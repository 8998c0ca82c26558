"""Helpers shared by several test files (imported as `from helpers import ...`)."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from scipy import stats

from deepspec.core.decode import Proposal
from deepspec.core.verify import logits_to_probs, sample
from deepspec.formats import convert

REPO = Path(__file__).resolve().parents[1]


CONVERSATIONS = [
    [("What is 12 + 30?", "12 + 30 = 42. The answer is 42."),
     ("And doubled?", "Doubling 42 gives 84.")],
    [("Name three primary colours.", "Red, yellow and blue are the three primary colours.")],
    [("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b")],
    [("Say hello in French.", "Bonjour! That is hello in French.")],
    [("What is the capital of Italy?", "The capital of Italy is Rome, a city with a long history.")],
]


def write_conversations(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, turns in enumerate(CONVERSATIONS):
            msgs = [m for u, a in turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]
            f.write(json.dumps({"id": f"hand:{i}", "source": "hand", "messages": msgs}) + "\n")


# A short prompt whose first token is near-certain under the tiny target (p = 0.99), so the
# samples concentrate on a few (t1, t2) cells where the over-confident double's residual
# differs most from p_t (chosen by a one-off scan of random 5-token prompts).
PROMPT = [2293, 591, 4056, 15548, 17964]


class DistortedTargetDrafter:
    """Test double with the drafter API: drafts gamma tokens autoregressively from
    softmax((target_logits * SHARP + bias[prev]) / T), KV-free (re-reads the full
    verified context). It asserts the loop's bookkeeping: feats cover exactly the
    positions verified since the last call, and (if check_feats) equal the target's
    own features there. Draft distributions are memoised per context (the samples share
    a handful of contexts), so the double costs almost nothing."""

    SHARP = 2.0  # over-confident: high acceptance, and a residual far from p_t

    def __init__(self, target, layers, gamma=2, check_feats=False, conf=False):
        self.target, self.layers, self.gamma = target, list(layers), gamma
        self.check_feats, self.conf = check_feats, conf
        g = torch.Generator().manual_seed(7)
        self.bias = 0.3 * torch.randn(64, target.vocab_size, generator=g)  # depends on prev token mod 64
        self.memo = {}

    def init_state(self):
        return {"ids": []}

    @torch.no_grad()
    def propose(self, state, feats, tokens, *, temperature=1.0, generator=None):
        n = tokens.shape[1] - 1
        assert feats.shape[:2] == (1, n) and n >= 1, (feats.shape, tokens.shape)
        state["ids"] += tokens[0, :-1].tolist()
        if self.check_feats:
            ref, _ = self.target.features(torch.tensor([state["ids"]]), self.layers)
            torch.testing.assert_close(feats, ref[:, -n:], rtol=1e-4, atol=1e-4)
        seq = state["ids"] + [int(tokens[0, -1])]
        toks, probs = [], []
        for _ in range(self.gamma):
            p = self._dist(tuple(seq), temperature)
            t = int(sample(p, generator))
            toks.append(t)
            probs.append(p)
            seq.append(t)
        conf = torch.linspace(2.0, -2.0, self.gamma)[None] if self.conf else None
        return Proposal(torch.tensor([toks]), torch.stack(probs)[None], conf)

    def _dist(self, seq, temperature):
        key = (seq, temperature, self.SHARP)
        if key not in self.memo:
            logits = self.target.model(torch.tensor([seq]), logits_to_keep=1).logits[0, -1]
            self.memo[key] = logits_to_probs(logits * self.SHARP + self.bias[seq[-1] % 64], temperature)
        return self.memo[key]


def chi2_pvalue(samples, exact, min_cells=4) -> float:
    n = len(samples)
    cells = [s for s, p in exact.items() if n * p >= 5]
    counts = Counter(samples)
    obs = [counts[s] for s in cells]
    exp = [n * exact[s] for s in cells]
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    assert len(cells) >= min_cells, "too few cells for a meaningful test"
    return float(stats.chisquare(obs, exp).pvalue)


def randomize(d, seed=0):
    """Random weights everywhere (norm scales away from 1, layer_scalar != 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            base = 1.0 if p.dim() == 1 else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g) / (1 if p.dim() == 1 else math.sqrt(p.shape[-1])))
        for name, b in d.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.7)
    return d


def random_drafter(method, target, cfg, **drafter):
    """A drafter with random weights (`randomize`) for `target`, the preset's drafter
    section updated by `drafter`, 1 (Eagle3) or 2 layers; a reserved mask token's row
    set again after randomizing. Returns (drafter, its config)."""
    import copy

    from deepspec.drafters import build_drafter, freeze_mask_embedding

    c = copy.deepcopy(cfg)
    c["drafter"].update(drafter)
    c["drafter"]["num_layers"] = {"eagle3": 1, "dflash": 2, "dspark": 2}
    torch.manual_seed(0)
    d = randomize(build_drafter(method, target, c).eval())
    freeze_mask_embedding(d, target, init=True)
    return d, c


def plain_ttt(d, W, ids, feats, steps, arch, embed):
    """The TTT forward from the equations: post-norm outputs per step."""
    B, L = ids.shape
    cfg = d.config
    t = torch.arange(L)
    g = feats @ W["fc.weight"].T
    n_layers = cfg.num_hidden_layers
    keys, vals = [[] for _ in range(n_layers)], [[] for _ in range(n_layers)]
    outs = []
    for s in range(steps):
        e = embed(ids[:, (t + 1 + s).clamp(max=L - 1)])
        cos, sin = d.rotary(g, (t + s).expand(B, L))
        # row t sees step-0 keys j <= t and its own row in steps 1..s
        allowed = torch.cat([torch.ones(L, L).tril().bool()] + [torch.eye(L).bool()] * s, 1)
        for i in range(n_layers):
            g = plain_layer(W, f"layers.{i}.", e, g, cos, sin, keys[i], vals[i], allowed, arch, cfg)
        outs.append(rms(g, W["norm.weight"], cfg.rms_norm_eps))
    return outs


def reference_config(d, target) -> dict:
    """A reference-style config.json for drafter d (target config + reference fields)."""
    c = {k: v for k, v in d.config.to_dict().items() if not k.startswith("deepspec_")}
    r = d.config.deepspec_markov_rank
    c.update(architectures=["Qwen3DSparkModel"], num_target_layers=target.num_layers,
             block_size=d.config.deepspec_block_size, target_layer_ids=d.config.deepspec_feature_layers,
             mask_token_id=MASK_ID, num_anchors=512, enable_confidence_head=d.config.deepspec_confidence_head,
             markov_rank=r)
    if d.config.deepspec_confidence_head:
        c["confidence_head_with_markov"] = d.config.deepspec_confidence_with_markov
    if r > 0:
        c["markov_head_type"] = d.config.deepspec_markov_head_type
    return c


def write_reference(d, target, path, *, with_target_copies=False, shards=1, config=None, extra=None, drop=(),
                    dtype=torch.float32):
    """Write drafter d in the reference layout (top-level names, reference head names)."""
    path.mkdir(parents=True)
    sd = {convert.to_reference(k): v.detach().clone().contiguous()
          for k, v in d.state_dict().items() if k not in convert.NOT_IN_CHECKPOINT}
    if with_target_copies:
        sd["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
        sd["lm_head.weight"] = target.lm_head.weight.detach().clone()
    sd = {k: v.to(dtype) for k, v in sd.items()}
    sd.update(extra or {})
    for k in drop:
        sd.pop(k)
    (path / "config.json").write_text(json.dumps(config or reference_config(d, target)))
    if shards == 1:
        save_file(sd, str(path / "model.safetensors"))
        return path
    names = sorted(sd)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in names[i::shards]}
        save_file(part, str(path / fname))
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def gemma4_reference_config(d, target, layout) -> dict:
    """config.json as the reference writes it for Gemma4: the target's text config
    (head_dim / num_key_value_heads of its sliding layers; the full-attention
    geometry the draft layers use either as global_head_dim /
    num_global_key_value_heads fields ("fields") or, from newer transformers, in
    per_layer_config keyed by target layer ("per_layer")), draft depth, all
    layers full attention, plus the reference fields."""
    from deepspec.targets.tiny import TINY_GEMMA4_CONFIG

    tc = target.config.get_text_config().to_dict()
    if layout == "fields":
        tc.pop("per_layer_config")
        tc.update(global_head_dim=TINY_GEMMA4_CONFIG["global_head_dim"],
                  num_global_key_value_heads=TINY_GEMMA4_CONFIG["num_global_key_value_heads"])
    assert tc["head_dim"] != d.config.head_dim  # the sliding head, not the draft's
    n = d.config.num_hidden_layers
    ref = {k: v for k, v in reference_config(d, target).items()
           if k in ("num_target_layers", "block_size", "target_layer_ids", "mask_token_id", "num_anchors",
                    "enable_confidence_head", "confidence_head_with_markov", "markov_rank", "markov_head_type")}
    return dict(tc, **ref, architectures=["Gemma4DSparkModel"], target_model_type=tc["model_type"],
                target_text_model_type=tc["model_type"], num_hidden_layers=n, layer_types=["full_attention"] * n,
                enable_moe_block=False, hidden_size_per_layer_input=0, tie_word_embeddings=False)


def copy_workflow(dst: Path) -> None:
    """The DAG (Snakefile, workflow/, profiles/, the rules' environment.yml), the
    presets and the package (a link to this checkout's deepspec/, which the
    Snakefile imports): run from `dst` as from the repository root."""
    for name in ["workflow", "config", "profiles"]:
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ["Snakefile", "environment.yml"]:
        shutil.copy(REPO / name, dst / name)
    (dst / "deepspec").symlink_to(REPO / "deepspec", target_is_directory=True)


def snakemake(cwd, *args, env=None, timeout=600):
    cmd = [sys.executable, "-m", "snakemake", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)


def rms(x, w=None, eps=1e-6):
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.float()


def plain_layer(W, p, e, g, cos, sin, keys, vals, allowed, arch, cfg):
    """One standard EAGLE-3 layer on rows; keys/vals: lists of earlier steps' [B,Hkv,L,hd]."""
    eps = cfg.rms_norm_eps
    x = torch.cat([rms(e, W[p + "input_layernorm.weight"], eps), rms(g, W[p + "hidden_norm.weight"], eps)], -1)
    H = cfg.num_attention_heads
    q = heads(x @ W[p + "self_attn.q_proj.weight"].T, H)
    kr = x @ W[p + "self_attn.k_proj.weight"].T
    Hkv = kr.shape[-1] // q.shape[-1]
    k = heads(kr, Hkv)
    v = heads(x @ W[p + "self_attn.v_proj.weight"].T, Hkv) if p + "self_attn.v_proj.weight" in W else k
    if arch in ("qwen3", "gemma4"):
        q, k = rms(q, W[p + "self_attn.q_norm.weight"], eps), rms(k, W[p + "self_attn.k_norm.weight"], eps)
    if arch == "gemma4":
        v = rms(v, None, eps)
    keys.append(rot(k, cos, sin))
    vals.append(v)
    K, V = torch.cat(keys, 2), torch.cat(vals, 2)
    K, V = K.repeat_interleave(H // Hkv, 1), V.repeat_interleave(H // Hkv, 1)
    scale = 1.0 if arch == "gemma4" else q.shape[-1] ** -0.5
    scores = (rot(q, cos, sin) @ K.transpose(-1, -2)) * scale
    a = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ V
    o = a.transpose(1, 2).reshape(g.shape[0], g.shape[1], -1) @ W[p + "self_attn.o_proj.weight"].T
    act = F.gelu if arch == "gemma4" else F.silu
    kw = {"approximate": "tanh"} if arch == "gemma4" else {}

    def mlp(h):
        return (act(h @ W[p + "mlp.gate_proj.weight"].T, **kw) * (h @ W[p + "mlp.up_proj.weight"].T)) \
            @ W[p + "mlp.down_proj.weight"].T

    if arch != "gemma4":
        h = g + o
        return h + mlp(rms(h, W[p + "post_attention_layernorm.weight"], eps))
    h = g + rms(o, W[p + "post_attention_layernorm.weight"], eps)
    h = h + rms(mlp(rms(h, W[p + "pre_feedforward_layernorm.weight"], eps)), W[p + "post_feedforward_layernorm.weight"], eps)
    return h * W[p + "layer_scalar"]


MASK_ID = 7  # stands in for Qwen3's reserved 151669


def rot(x, cos, sin):  # x [B, H, L, hd], cos/sin [B, L, hd]
    x1, x2 = x.chunk(2, -1)
    return x * cos.unsqueeze(1) + torch.cat([-x2, x1], -1) * sin.unsqueeze(1)


def heads(x, n):  # [B, L, n*hd] -> [B, n, L, hd]
    B, L, _ = x.shape
    return x.view(B, L, n, -1).transpose(1, 2)


def local_rules(workdir: Path, preset: str = "qwen3-4b") -> list[str] | None:
    """The workflow's localrules for `preset`, read through Snakemake's API in a
    subprocess run in `workdir` (a copy of the workflow); None if it failed."""
    code = ("from pathlib import Path\n"
            "from snakemake.api import SnakemakeApi\n"
            "from snakemake.settings.types import OutputSettings, ConfigSettings, ResourceSettings, StorageSettings\n"
            "with SnakemakeApi(OutputSettings()) as api:\n"
            "    wf = api.workflow(resource_settings=ResourceSettings(cores=1), storage_settings=StorageSettings(),\n"
            f"                      config_settings=ConfigSettings(config={{'preset': {preset!r}}}),\n"
            "                      snakefile=Path('Snakefile'), workdir=Path('.'))\n"
            "    print('LOCAL', ' '.join(sorted(wf._workflow._localrules)))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=300)
    return next((ln.split()[1:] for ln in r.stdout.splitlines() if ln.startswith("LOCAL")), None)


# the paper presets' CPU rehearsals and the preset each rehearses
REHEARSALS = {"rehearsal-qwen3": "qwen3-4b", "rehearsal-gemma4": "gemma4-12b"}


def shell_commands(out: str) -> list[str]:
    """The shell commands a `snakemake -p` run printed."""
    return [line.split("Shell command: ", 1)[1] for line in out.splitlines() if "Shell command: " in line]
