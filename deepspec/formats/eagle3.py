"""The EAGLE-3 (SpecForge / vLLM / SGLang) layout: one decoder layer under
`midlayer.*`, `fc`, `norm`, `lm_head` = the target head's rows of the draft
vocabulary, `d2t` / `t2d` for a reduced one (docs/FORMATS.md)."""
from __future__ import annotations

import torch

from .common import EAGLE3_ARCH, base_config, refuse
from .convert import NOT_IN_CHECKPOINT


def eagle3_layout(d, target):
    """(config dict, tensors) of an Eagle3 drafter in the EAGLE-3 layout."""
    c = d.config
    if d.method != "eagle3":
        refuse(f"a {d.method} drafter as eagle3", "only Eagle3 drafters have that layout")
    if c.model_type not in EAGLE3_ARCH:
        refuse(f"a {c.model_type} Eagle3 layer as eagle3", f"the engines' EAGLE-3 classes have the "
                f"{' and '.join(sorted(EAGLE3_ARCH))} layers only")
    if c.num_hidden_layers != 1:
        refuse("as eagle3", f"the layout has one decoder layer (midlayer), this drafter has {c.num_hidden_layers}")
    layers = list(c.deepspec_feature_layers)  # vLLM sizes fc from this list's length (any count)
    K, V = d.draft_vocab_size, d.vocab_size
    d2t = d.d2t.detach().cpu() if d.reduced_vocab else torch.arange(V)
    cfg = dict(base_config(d), architectures=[EAGLE3_ARCH[c.model_type]], vocab_size=V, draft_vocab_size=K,
               target_hidden_size=int(c.deepspec_target_hidden_size), num_hidden_layers=1,
               eagle_aux_hidden_state_layer_ids=[x + 1 for x in layers],
               eagle_config={"eagle_aux_hidden_state_layer_ids": layers,  # SGLang adds the 1 itself
                             "use_aux_hidden_state": True},
               deepspec_feature_layers=layers, deepspec_ttt_length=int(c.deepspec_ttt_length))
    sd = {}
    for k, v in d.state_dict().items():
        if k in NOT_IN_CHECKPOINT:
            continue
        sd[k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k] = v.detach().clone()
    sd["lm_head.weight"] = target.lm_head.weight.detach()[d2t.to(target.lm_head.weight.device)].float().cpu()
    if d.reduced_vocab:  # the engines create the vocabulary map only for K < V (and refuse it otherwise)
        sd["d2t"] = d2t - torch.arange(K)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[d2t] = True
        sd["t2d"] = t2d
    return cfg, sd



def expected_tensors(fmt: str, cfg: dict) -> dict[str, tuple]:
    """The names and shapes an `eagle3` export must hold (docs/FORMATS.md),
    from its config: what SpecForge's exporter checks before writing."""
    if fmt != "eagle3":
        raise ValueError(fmt)
    d, H, Hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // H
    m = len(cfg["eagle_aux_hidden_state_layer_ids"])
    out = {"fc.weight": (d, m * cfg["target_hidden_size"]), "norm.weight": (d,),
           "lm_head.weight": (cfg["draft_vocab_size"], d), "midlayer.hidden_norm.weight": (d,),
           "midlayer.input_layernorm.weight": (d,), "midlayer.post_attention_layernorm.weight": (d,),
           "midlayer.self_attn.q_proj.weight": (H * hd, 2 * d), "midlayer.self_attn.k_proj.weight": (Hkv * hd, 2 * d),
           "midlayer.self_attn.v_proj.weight": (Hkv * hd, 2 * d), "midlayer.self_attn.o_proj.weight": (d, H * hd),
           "midlayer.mlp.gate_proj.weight": (cfg["intermediate_size"], d),
           "midlayer.mlp.up_proj.weight": (cfg["intermediate_size"], d),
           "midlayer.mlp.down_proj.weight": (d, cfg["intermediate_size"])}
    if cfg["draft_vocab_size"] < cfg["vocab_size"]:  # the vocabulary map of a reduced draft vocabulary
        out.update({"d2t": (cfg["draft_vocab_size"],), "t2d": (cfg["vocab_size"],)})
    if cfg["architectures"][0] == "Eagle3Qwen3ForCausalLM":
        out.update({"midlayer.self_attn.q_norm.weight": (hd,), "midlayer.self_attn.k_norm.weight": (hd,)})
    return out



def check_eagle3(cfg: dict, sd: dict) -> None:
    want = expected_tensors("eagle3", cfg)
    have = {k: tuple(v.shape) for k, v in sd.items()}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            refuse("as eagle3", f"tensor {name}: expected {want.get(name)}, have {have.get(name)} "
                    "(the engines drop or miss such names silently)")
