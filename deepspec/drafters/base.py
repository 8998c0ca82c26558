"""What the three drafters share (paper Sec. 3, Eq. 2; Sec. 4.1).

* `DrafterBase` - a transformers `PreTrainedModel` whose config is a copy of
  the target's config (same hidden size, heads, MLP; `num_hidden_layers` = draft
  layers), or with drafter.layer_arch qwen3 a Qwen3 config of the target's sizes
  (`blocks.qwen3_draft_config`), plus `deepspec_*` fields: target id, vocab and hidden size, feature
  layers, block size, method and head settings. The target's embedding and LM
  head are *shared, frozen and not saved*: `attach_target` links them (they are
  never registered as sub-modules, so `parameters()` holds only trainable
  weights and `save_pretrained` writes only the drafter's own tensors).
* Reduced draft vocabulary (`draft_vocab_size`): a persistent `d2t` buffer maps
  draft index -> target id (the K most frequent training tokens); the draft LM
  head is the target head restricted to those rows and `to_full_vocab` scatters
  draft probabilities back onto the full target vocabulary (zeros elsewhere),
  so verification stays lossless.
* Context features H_ctx = RMSNorm(W_c [h^(l1); ...; h^(lm)]) (Eq. 2): `fc` +
  `hidden_norm` built by `feature_projection`.
* Building blocks (attention, RMSNorm, rotary embedding, MLP, decoder layer)
  come from the draft config's transformers modeling module
  (`blocks.blocks_for`): the target's, or Qwen3's with layer_arch qwen3.
* `propose` returns a `core.decode.Proposal` (docs/INTERFACES.md).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Mapping, Optional, Sequence

import torch
import torch.nn as nn
from transformers import AutoConfig, PreTrainedConfig, PreTrainedModel

from ..architectures import draft_model_type, layer_arch_of, same_layers
from ..core.target import packed_linear
from ..errors import DeepSpecError
from ..settings import Drafter
from .blocks import blocks_for, gemma4_draft_config, qwen3_draft_config

METHODS = ("eagle3", "dflash", "dspark")


# ----------------------------------------------------------------------------------------------
# config


def draft_config(method: str, target, drafter: Drafter | Mapping, feature_layers: Sequence[int]):
    """Copy of the target's (text) config with the draft depth and the deepspec_* fields
    of the drafter settings, reading `feature_layers` of the target (drafter.layer_arch
    qwen3 over a non-Qwen3 target: a Qwen3 config of its sizes)."""
    d = Drafter.view(drafter)
    tc = target.text_config
    n = int(d.num_layers[method])  # the schema gives every method its default depth
    layers = draft_model_type(tc.model_type, layer_arch_of(d, method), f"{method} drafter")
    if blocks_for(tc).family == "gemma4":
        c = gemma4_draft_config(tc, n)
    elif layers != tc.model_type:
        c = qwen3_draft_config(tc, n)
    else:
        c = tc.__class__.from_dict(copy.deepcopy(tc.to_dict()))
    c.num_hidden_layers = n
    if getattr(c, "layer_types", None) is not None:
        c.layer_types = ["full_attention"] * n  # the drafts use full attention (reference)
    if hasattr(c, "use_sliding_window"):
        c.use_sliding_window = False
    c.tie_word_embeddings = False  # no embedding/LM head of its own
    c.use_cache = False
    c._attn_implementation = "sdpa"
    dspark = method == "dspark"
    c.deepspec_method = method
    c.deepspec_target_id = target.target_id
    c.deepspec_target_vocab_size = int(target.vocab_size)
    c.deepspec_target_hidden_size = int(target.hidden_size)
    c.deepspec_target_num_layers = int(target.num_layers)
    c.deepspec_feature_layers = [int(x) for x in feature_layers]
    c.deepspec_block_size = d.block_size
    c.deepspec_ttt_length = d.ttt_length
    c.deepspec_markov_rank = d.markov_rank if dspark else 0
    c.deepspec_markov_head_type = d.markov_head_type if dspark else "vanilla"
    c.deepspec_confidence_head = d.confidence_head if dspark else False
    c.deepspec_confidence_with_markov = d.confidence_with_markov
    # the block drafters' mask input: the target's frozen embedding of a reserved
    # token (the reference's mask_token_id) or, when None, a learned vector
    c.deepspec_mask_token_id = d.mask_token_id if method in ("dflash", "dspark") else None
    k = d.draft_vocab_size
    c.deepspec_draft_vocab_size = None if k is None or k >= target.vocab_size else k
    return c


def check_target_match(config, target, where: str = "drafter") -> None:
    want = {
        "target id": (getattr(config, "deepspec_target_id", None), target.target_id),
        "vocab size": (getattr(config, "deepspec_target_vocab_size", None), int(target.vocab_size)),
        "hidden size": (getattr(config, "deepspec_target_hidden_size", None), int(target.hidden_size)),
    }
    for name, (have, got) in want.items():
        if have != got:
            raise DeepSpecError(f"{where} was trained for target {name} {have!r} but the target has {got!r}")
    for layer in getattr(config, "deepspec_feature_layers", []):
        if not -1 <= layer < target.num_layers - 1:
            raise DeepSpecError(f"{where}: feature layer {layer} does not exist in the target")


def check_layer_arch(config, target, drafter_cfg: Drafter | Mapping, where: str = "drafter") -> None:
    """A saved drafter's layers (its config's model type) against what the config's
    drafter.layer_arch builds for this target and the drafter's method."""
    method = config.deepspec_method
    arch = layer_arch_of(drafter_cfg, method)
    want = draft_model_type(target.text_config.model_type, arch, where)
    if not same_layers(config.model_type, want):
        raise DeepSpecError(f"{where} has {config.model_type} draft layers, but drafter.layer_arch {arch!r} builds "
                            f"{want} layers for {method} over this target: retrain, or set drafter.layer_arch")


def read_config_json(path) -> dict:
    """A saved drafter's config.json as a dict; missing, malformed or not an object is one line."""
    p = Path(path) / "config.json"
    if not p.exists():
        raise DeepSpecError(f"no drafter checkpoint at {path} (config.json missing)")
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raw = None
    if not isinstance(raw, dict):
        raise DeepSpecError(f"{p}: malformed drafter config (not a JSON object)")
    return raw


def read_method(path) -> str:
    p = Path(path) / "config.json"
    m = read_config_json(path).get("deepspec_method")
    if m not in METHODS:
        raise DeepSpecError(f"{p}: not a deepspec drafter (deepspec_method={m!r})")
    return m


# ----------------------------------------------------------------------------------------------
# base model


class DrafterBase(PreTrainedModel):
    config_class = PreTrainedConfig
    base_model_prefix = "drafter"
    _supports_sdpa = True
    supports_gradient_checkpointing = False
    # What the training step needs to know (core/train_step.py): whether the
    # loss distils p_t (L1 and confidence terms, DSpark) or is CE only; each
    # drafter family binds its step function as `training_step`.
    distills = False

    def __init__(self, config):
        super().__init__(config)
        V = config.deepspec_target_vocab_size
        K = config.deepspec_draft_vocab_size or V
        self.blocks = blocks_for(config)
        self.register_buffer("d2t", torch.arange(K, dtype=torch.long), persistent=True)
        self._shared = SimpleNamespace(embed=None, lm_head=None, head_w=None, head_b=None, t2d=None, softcap=None)

    def _init_weights(self, module):
        super()._init_weights(module)
        # Gemma4TextRotaryEmbedding keeps one (non-persistent) inv_freq per layer type,
        # which PreTrainedModel's generic init does not rebuild when loading; recompute
        # them as transformers' Gemma4PreTrainedModel does.
        fns = getattr(module, "rope_init_fns", None)
        if isinstance(fns, dict):
            with torch.no_grad():
                for layer_type, fn in fns.items():
                    inv_freq, _ = fn(module.config.per_layer_config[layer_type], layer_type=layer_type)
                    getattr(module, f"{layer_type}_inv_freq").copy_(inv_freq)
                    getattr(module, f"{layer_type}_original_inv_freq").copy_(inv_freq)

    # -- loading: the config is the target architecture's config class
    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        if kwargs.get("config") is None:
            kwargs["config"] = AutoConfig.from_pretrained(path)
        return super().from_pretrained(path, *args, **kwargs)

    @property
    def method(self) -> str:
        return self.config.deepspec_method

    @property
    def vocab_size(self) -> int:
        return self.config.deepspec_target_vocab_size

    @property
    def reduced_vocab(self) -> bool:
        return self.config.deepspec_draft_vocab_size is not None

    @property
    def draft_vocab_size(self) -> int:
        """K: the size of the draft vocabulary (the target's when not reduced)."""
        return self.d2t.numel() if self.reduced_vocab else self.vocab_size

    def kv_bytes_per_token(self, dtype: Optional[torch.dtype] = None) -> int:
        """The K/V bytes the drafter keeps per context position of a request (every
        draft layer's keys and values, in its dtype or `dtype`): what it adds to the target's KV
        cache in the batched engine's admission and in `plan`. Gemma4 draft layers are
        all full attention, with the global heads and width."""
        c = self.config
        heads = int(getattr(c, "num_global_key_value_heads", None) or c.num_key_value_heads or c.num_attention_heads)
        width = int(getattr(c, "global_head_dim", None) or getattr(c, "head_dim", None)
                    or c.hidden_size // c.num_attention_heads)
        elem = (torch.empty(0, dtype=dtype) if dtype is not None else next(self.parameters())).element_size()
        return int(c.num_hidden_layers) * heads * width * 2 * elem

    # -- shared frozen target modules
    def attach_target(self, target) -> "DrafterBase":
        check_target_match(self.config, target)
        self._shared.embed = target.embed_tokens
        self._shared.lm_head = target.lm_head
        # Gemma-style final-logit soft-capping (z -> cap * tanh(z / cap)) is part
        # of the target's distribution, so drafts and p_t must apply it too.
        self._shared.softcap = getattr(target.text_config, "final_logit_softcapping", None)
        self._refresh_head()
        return self

    def _require_target(self):
        if self._shared.lm_head is None:
            raise DeepSpecError("drafter has no target attached (use build_drafter/load_drafter)")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's (frozen) input embedding; Gemma4's scales by sqrt(d), as the
        reference draft embedding does."""
        self._require_target()
        return self._shared.embed(ids.to(self._shared.embed.weight.device)).to(self.d2t.device)

    def _refresh_head(self) -> None:
        lm = self._shared.lm_head
        if lm is None:
            return
        w, b = lm.weight.detach(), getattr(lm, "bias", None)
        d2t = self.d2t.to(w.device)
        self._shared.head_w = w[d2t] if self.reduced_vocab else w
        self._shared.head_b = None if b is None else (b.detach()[d2t] if self.reduced_vocab else b.detach())
        t2d = torch.full((self.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        t2d[self.d2t] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        self._shared.t2d = t2d

    def set_draft_vocab(self, token_counts: torch.Tensor) -> None:
        """Reduced vocabulary: keep the K most frequent target tokens (counts [V]
        from the training data, e.g. `count_tokens`)."""
        if not self.reduced_vocab:
            return
        K = self.config.deepspec_draft_vocab_size
        counts = torch.as_tensor(token_counts, dtype=torch.float64).flatten()
        if counts.numel() != self.vocab_size:
            raise DeepSpecError(f"token counts have {counts.numel()} entries, target vocab is {self.vocab_size}")
        # ties broken by the lower id (stable): a small-valued tiebreak
        idx = torch.topk(counts - torch.arange(counts.numel(), dtype=torch.float64) * 1e-9, K).indices
        self.d2t.copy_(idx.sort().values.to(self.d2t.device))
        self._refresh_head()

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Frozen (restricted) LM head on draft hidden states: [..., K]."""
        self._require_target()
        w, b = self._shared.head_w, self._shared.head_b
        # Cast the activations, not the V x d head: no full-vocab weight copy per call.
        return self._softcap(packed_linear(h.to(w.dtype), w, b).to(h.dtype))  # F.linear but in prepacked_linears

    def _softcap(self, z: torch.Tensor) -> torch.Tensor:
        cap = self._shared.softcap
        return z if not cap else torch.tanh(z / cap) * cap

    @torch.no_grad()
    def target_probs(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """p_t = softmax of the frozen full LM head on cached final-norm states [..., V]."""
        self._require_target()
        z = self._shared.lm_head(last_hidden.to(self._shared.lm_head.weight.dtype)).float()
        return torch.softmax(self._softcap(z), -1)

    @torch.no_grad()
    def draft_vocab_target_probs(self, last_hidden: torch.Tensor, log_normalizer: Optional[torch.Tensor] = None):
        """p_t on the draft vocabulary [..., K] and the target mass outside it [...]
        (None when the vocabularies coincide), as `restrict_to_draft_vocab(target_probs(.))`.
        With the target's log-normalizer of these states [...] (`Target.log_normalizer`,
        stored in the cache) only the K draft columns of the LM head are computed:
        p_t = exp(z_K - log sum_V exp z)."""
        if log_normalizer is None or not self.reduced_vocab:
            return self.restrict_to_draft_vocab(self.target_probs(last_hidden))
        self._require_target()
        w, b = self._shared.head_w, self._shared.head_b
        z = self._softcap(torch.nn.functional.linear(last_hidden.to(w.dtype), w, b).float())
        pin = torch.exp(z - log_normalizer.to(z.device, torch.float32).unsqueeze(-1))
        return pin, (1.0 - pin.sum(-1)).clamp_min(0.0)

    def restrict_to_draft_vocab(self, pt: torch.Tensor):
        """Target probabilities [..., V] on the draft vocabulary [..., K], plus the
        target mass outside it [...] (None when the vocabularies coincide)."""
        if not self.reduced_vocab:
            return pt, None
        pin = pt.index_select(-1, self.d2t.to(pt.device))
        return pin, (1.0 - pin.sum(-1)).clamp_min(0.0)

    def to_full_vocab(self, p: torch.Tensor) -> torch.Tensor:
        if not self.reduced_vocab:
            return p
        out = p.new_zeros(*p.shape[:-1], self.vocab_size)
        return out.scatter(-1, self.d2t.expand(*p.shape[:-1], -1), p)

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return self.d2t[idx] if self.reduced_vocab else idx

    def to_draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft indices (-1 outside the draft vocabulary)."""
        return self._shared.t2d[ids] if self.reduced_vocab else ids

    def rotary(self, x: torch.Tensor, pos: torch.Tensor):
        """(cos, sin) at positions `pos` from the draft's rotary embedding (Gemma4's
        takes the layer type: full attention)."""
        return self.rotary_emb(x, pos, **self.blocks.rope_kwargs)

    def init_layers_from_target(self, target, layers: nn.ModuleList, final_norm: Optional[nn.Module]) -> None:
        """init_from_target: draft layer i <- target layer (L - k + i), i.e. the last
        k target layers; the final norm from the target's."""
        decoder = target.model.get_decoder()  # the text decoder (also inside a multimodal Gemma4 wrapper)
        tl = decoder.layers
        k = len(layers)
        for i, layer in enumerate(layers):
            src = tl[len(tl) - k + i].state_dict()
            # Gemma4: a sliding-attention source layer has a narrower attention than the
            # full-attention draft layer; only tensors of matching shape are copied.
            own = layer.state_dict()
            src = {n: w for n, w in src.items() if n not in own or own[n].shape == w.shape}
            missing, _ = layer.load_state_dict(src, strict=False)
            if len(missing) == len(layer.state_dict()):
                raise DeepSpecError("init_from_target: draft and target layers share no weights")
        if final_norm is not None:
            final_norm.load_state_dict(decoder.norm.state_dict())

    def feature_projection(self):
        c = self.config
        m = len(c.deepspec_feature_layers)
        return nn.Linear(m * c.hidden_size, c.hidden_size, bias=False), self.blocks.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


def count_tokens(input_ids_iter, vocab_size: int, loss_masks_iter=None) -> torch.Tensor:
    """Token counts [V] over training sequences (for `set_draft_vocab`)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    masks = loss_masks_iter if loss_masks_iter is not None else None
    for i, ids in enumerate(input_ids_iter):
        ids = torch.as_tensor(ids).flatten()
        if masks is not None:
            ids = ids[torch.as_tensor(masks[i]).flatten().bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts
