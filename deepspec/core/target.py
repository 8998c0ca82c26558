"""The frozen target as decoding and the drafters see it (paper Sec. 2-3):
its forward with a KV cache, its feature layers (Eq. 2's h^(l)), its final
hidden state, embedding and LM head, and its chat template. Loading targets
(by spec, offline conversion, the tiny test models) is the pipeline's
`deepspec.targets.loading`.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import DeepSpecError


@dataclass
class Target:
    """A frozen target model with what drafters and the decode loop need."""

    model: torch.nn.Module
    tokenizer: object
    target_id: str
    revision: Optional[str] = None
    eos_token_ids: tuple = field(default_factory=tuple)
    packed_matmuls: bool = False  # decoding's CPU linear layers through oneDNN (`prepacked_linears`; target.cpu_matmul)

    @property
    def config(self):
        return self.model.config

    @property
    def text_config(self):
        """The decoder's config: the config itself for text models; `text_config` of a
        multimodal wrapper (the Gemma4 hub checkpoints load as Gemma4ForConditionalGeneration)."""
        c = self.model.config
        return c.get_text_config() if hasattr(c, "get_text_config") else c

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def context_length(self) -> Optional[int]:
        """The most positions the target was built for (max_position_embeddings; None if unknown)."""
        n = getattr(self.text_config, "max_position_embeddings", None)
        return int(n) if n else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered by the target's chat template
        (non-thinking; no system prompt is added by us)."""
        return render_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tokenize=True)

    def check_feature_layers(self, layers: Sequence[int]) -> list[int]:
        return check_feature_layers(layers, self.num_layers)

    @torch.no_grad()
    def features(
        self,
        input_ids: torch.Tensor,
        layers: Sequence[int],
        attention_mask: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated outputs of `layers` [B, L, m*d] and the final-norm hidden
        state [B, L, d] for a batch, without computing full logits."""
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=None if attention_mask is None else attention_mask.to(self.device),
            output_hidden_states=True,
            use_cache=False,
            logits_to_keep=1,
        )
        return select_features(out.hidden_states, layers), out.hidden_states[-1]

    @torch.no_grad()
    def log_normalizer(self, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """log sum_v exp(z_v) [...] float32 of the target's logits z (soft-capped where the
        target caps them) on final-norm states [..., d], `chunk` rows at a time: with it,
        p_t on a reduced draft vocabulary costs that vocabulary's columns of the LM head,
        not all V (`DrafterBase.draft_vocab_target_probs`; the cache stores it)."""
        head = self.lm_head
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        x = last_hidden.reshape(-1, last_hidden.shape[-1])
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for i in range(0, x.shape[0], chunk):
            z = head(x[i : i + chunk].to(device=head.weight.device, dtype=head.weight.dtype)).float()
            if cap:
                z = torch.tanh(z / cap) * cap
            out[i : i + chunk] = torch.logsumexp(z, -1).to(out.device)
        return out.view(last_hidden.shape[:-1])


def cache_kwarg(module) -> str:
    """Name of the KV-cache argument of a transformers forward: `cache` in recent
    5.x releases, `past_key_values` before (and in 4.x)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def check_feature_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    layers = [int(x) for x in layers]
    for layer in layers:
        if layer < -1 or layer >= num_layers - 1:
            raise DeepSpecError(
                f"feature layer {layer} out of range: use -1 (embeddings) .. {num_layers - 2}; the final "
                f"layer {num_layers - 1} is not allowed (HF stores its post-norm value)"
            )
    return layers


def select_features(hidden_states: Sequence[torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """HF indexing: hidden_states[0] is the embedding output, hidden_states[l+1]
    the output of decoder layer l; the last entry is after the final norm, which
    is why the final layer may not be a feature layer."""
    return torch.cat([hidden_states[layer + 1] for layer in layers], dim=-1)


def render_chat(tokenizer, messages, add_generation_prompt=True, tokenize=False):
    kwargs = dict(add_generation_prompt=add_generation_prompt, enable_thinking=False)
    if tokenize:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def eos_ids(ids) -> tuple[int, ...]:
    """An eos_token_id field (an id, a list of ids, or None) as sorted unique ids."""
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return tuple(sorted(set(int(i) for i in ids)))


def eos_ids_of(model, tokenizer) -> tuple[int, ...]:
    """The ids that end generation: the generation config's, else the tokenizer's."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    if ids is None:
        ids = tokenizer.eos_token_id
    return eos_ids(ids)


def new_cache():
    """An empty transformers DynamicCache."""
    from transformers import DynamicCache

    return DynamicCache()


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a DynamicCache. A negative argument
    removes that many tokens in transformers 4.x and 5.x alike (5.x rejects positive ones)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


# The batch-size hint oneDNN packs the weights for (`prepacked_linears`): packed for 8
# rows, a 1,536 x 576 matmul takes the same 0.20 ms for 1 and for 8 rows on the CPU
# presets' machine, and 200-row prefills stay within 15 % of a pack for 64 rows.
PACK_ROWS = 8


@functools.lru_cache(maxsize=None)
def _packable_dtype(dtype: torch.dtype) -> bool:
    """fp32, or bf16 where oneDNN multiplies it (AVX-512 bf16 or AMX on the CPU); asked once
    per dtype, as every decoding round asks it."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packable(w: Optional[torch.Tensor]) -> bool:
    # (oneDNN crashes with SIGFPE on a zero-width weight, such as DFlash's empty Markov factor)
    return (w is not None and w.dim() == 2 and w.numel() > 0 and w.device.type == "cpu"
            and _packable_dtype(w.dtype))


# The packs of the `prepacked_linears` context in force ({weight: (version, pack)}, weakly keyed), or None.
_PACKS: contextvars.ContextVar = contextvars.ContextVar("deepspec_packed_linears", default=None)


def _pack(packs: WeakIdKeyDictionary, w: torch.Tensor) -> torch.Tensor:
    """w packed for oneDNN, packed once and again only if w changed in place."""
    e = packs.get(w)
    if e is None or e[0] != w._version:
        e = packs[w] = (w._version, torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_ROWS))
    return e[1]


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, w, b); inside `prepacked_linears`, through oneDNN on w packed once.
    The drafters' own heads multiply through here."""
    packs = _PACKS.get()
    if packs is None or not _packable(w) or x.dtype != w.dtype or x.device != w.device:
        return torch.nn.functional.linear(x, w, b)
    return _onednn_linear(x, _pack(packs, w), b)


@contextlib.contextmanager
def prepacked_linears(target: "Target", module: Optional[torch.nn.Module] = None):
    """Within this context (no gradients, CPU, fp32 or bf16) every linear layer of `module`
    (default: the target, its LM head included) and every `packed_linear` call
    multiplies through oneDNN with its weight packed once for the CPU's kernels
    (torch.ops.mkldnn, the path vLLM's CPU backend takes), instead of MKL's sgemm,
    which re-packs the weight at every call for the few rows of a decode or
    verification step: a one-token forward of SmolLM2-135M 1.6x faster, an 8-token
    verification 1.7x, an Eagle3 draft round 2x (docs/PERFORMANCE.md). The packs are
    kept on the target (a drafter's with them, for as long as its weights live) and
    redone if a weight changes. The
    logits differ from MKL's in rounding (~1e-4 absolute), so greedy rounds may
    differ from an engine's at near-ties; every forward of the decoding loops and
    the engine goes through here, so plain and speculative decoding see the same kernels.
    bf16 weights are packed too where oneDNN multiplies bf16 (`_packable_dtype`): on
    AMX-BF16 a one-token forward of SmolLM2-135M takes 0.66x the time of packed fp32
    and an 8-token verification 0.58x, where unpacked bf16 gains little at batch 1.
    Only for a target with `packed_matmuls` (target.cpu_matmul: onednn); elsewhere
    (gradients, GPU, other dtypes, no oneDNN) it changes nothing."""
    head = getattr(target.lm_head, "weight", None)
    if (not target.packed_matmuls or torch.is_grad_enabled() or not torch.backends.mkldnn.is_available()
            or head is None or head.device.type != "cpu" or not _packable_dtype(head.dtype)):
        yield  # a GPU target has nothing to pack: its linear layers are not even listed
        return
    module = target.model if module is None else module
    packs = target.__dict__.setdefault("_packed_linears", WeakIdKeyDictionary())
    found = target.__dict__.setdefault("_linear_modules", WeakIdKeyDictionary())
    if module not in found:  # its linear layers, listed once: [layer, weight, version, forward or None]
        mods = module.modules() if isinstance(module, torch.nn.Module) else []  # (a test double has none)
        found[module] = [[m, None, -1, None] for m in mods if isinstance(m, torch.nn.Linear)]
    patched = []
    for e in found[module]:
        m, w = e[0], e[0].weight
        if e[1] is not w or e[2] != w._version:  # first use, or a weight replaced or changed in place
            fn = functools.partial(_onednn_linear, packed=_pack(packs, w), bias=m.bias) if _packable(w) else None
            e[1:] = [w, w._version, fn]
        if e[3] is not None and "forward" not in m.__dict__:  # (the instance's dict: a forward of its own wins)
            m.__dict__["forward"] = e[3]
            patched.append(m)
    token = _PACKS.set(packs)
    try:
        yield
    finally:
        _PACKS.reset(token)
        for m in patched:
            del m.__dict__["forward"]


# Rows of the LM head per matmul when `lm_head_in_chunks` splits it. MKL's sgemm for a
# few rows against the 49k x 576 head of SmolLM2 packs the whole head per call; in
# 1,024-row slices (2.4 MB) it runs 1.5x faster at one thread (benchmarks/bench_vllm.py,
# docs/PERFORMANCE.md). Every logit is the same dot product either way, so the logits
# are the same bit for bit (tests/test_decode.py). At two threads each slice is a
# parallel region of its own, so it is done at one thread only.
LM_HEAD_CHUNK = 1024


@contextlib.contextmanager
def lm_head_in_chunks(target: "Target", chunk: int = LM_HEAD_CHUNK):
    """Within this context the target's LM head (an fp32 nn.Linear on the CPU, no
    gradients, one thread) computes its logits `chunk` vocabulary rows at a time,
    for inputs of more than one row; otherwise it is left as it is."""
    head = target.model.get_output_embeddings()
    w = getattr(head, "weight", None)
    if (not isinstance(head, torch.nn.Linear) or w is None or w.device.type != "cpu" or w.dtype != torch.float32
            or torch.is_grad_enabled() or torch.get_num_threads() != 1 or w.shape[0] <= chunk
            or "forward" in vars(head)):
        yield
        return
    bias = head.bias

    def forward(x):
        if x.numel() // max(1, x.shape[-1]) < 2:
            return torch.nn.functional.linear(x, w, bias)
        return torch.cat([torch.nn.functional.linear(x, w[i : i + chunk], None if bias is None else bias[i : i + chunk])
                          for i in range(0, w.shape[0], chunk)], -1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
