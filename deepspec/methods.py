"""Method names: eagle3, dflash, dspark and the ablation variants, named so
they can be Snakemake wildcards.

A variant name is ``<base>[-l<layers>][-b<block>]`` where base is one of
eagle3, dflash, dspark or dspark_rnn (DSpark with the RNN head of Eq. 6):

  dspark-l2       DSpark with 2 draft layers          (Figure 3)
  dflash-b11      DFlash with block 11 = draft length 12 (Figure 4)
  dspark_rnn-b15  DSpark, RNN head, block 15          (Figure 4)

``resolve_method(cfg, name)`` returns the base method and the config with the
variant's overrides applied (and per-method ``train.max_steps`` and
``train.lr`` mappings resolved to this method's value); ``method_settings``
the same as typed settings.
"""
from __future__ import annotations

import copy
import re
from typing import Mapping

from .config import as_config
from .errors import DeepSpecError
from .settings import Settings

PAPER_LR = 6.0e-4  # train.lr of a method a per-method mapping does not name (the schema's default)
BASES = {"eagle3": ("eagle3", {}), "dflash": ("dflash", {}), "dspark": ("dspark", {}),
         "dspark_rnn": ("dspark", {"markov_head_type": "rnn"})}
_NAME = re.compile(r"^(?P<base>[a-z0-9_]+?)(?:-l(?P<layers>\d+))?(?:-b(?P<block>\d+))?$")


def variant_base(name: str) -> str:
    """The variant's base name (eagle3, dflash, dspark or dspark_rnn)."""
    m = _NAME.match(name)
    if not m or m.group("base") not in BASES:
        raise DeepSpecError(f"unknown method '{name}' (use eagle3, dflash, dspark, dspark_rnn, optionally with -l<N> and -b<N>)")
    return m.group("base")


def resolve_method(cfg: Settings | Mapping, name: str) -> tuple[str, dict]:
    """(base method, the validated config with variant `name`'s overrides)."""
    m = _NAME.match(name)
    method, drafter_over = BASES[variant_base(name)]
    cfg = copy.deepcopy(as_config(cfg))
    cfg["drafter"].update(drafter_over)
    if m.group("layers"):
        cfg["drafter"]["num_layers"] = {**cfg["drafter"]["num_layers"], method: int(m.group("layers"))}
    steps = cfg["train"].get("max_steps")
    if isinstance(steps, dict):  # per-method caps: the base method's (or none)
        cfg["train"]["max_steps"] = steps.get(m.group("base"), steps.get(method))
    lr = cfg["train"].get("lr")
    if isinstance(lr, dict):  # per-method learning rates: the base method's (or the paper's)
        cfg["train"]["lr"] = lr.get(m.group("base"), lr.get(method, PAPER_LR))
    if m.group("block"):
        b = int(m.group("block"))
        cfg["drafter"]["block_size"] = b
        cfg["drafter"]["ttt_length"] = b
    return method, cfg


def method_settings(cfg: Settings | Mapping, name: str) -> tuple[str, Settings]:
    """`resolve_method` as typed settings: (base method, the variant's Settings)."""
    base, resolved = resolve_method(cfg, name)
    return base, Settings.of(resolved)


def fig3_methods(cfg: Settings | Mapping) -> list[str]:
    """DSpark at each depth of ablations.depths, plus 5-layer DFlash."""
    s = Settings.view(cfg)
    full = s.drafter.num_layers["dspark"]
    return [("dspark" if d == full else f"dspark-l{d}") for d in s.ablations.depths] + ["dflash"]


def fig4_methods(cfg: Settings | Mapping) -> list[str]:
    s = Settings.view(cfg)
    base_block = s.drafter.block_size
    out = []
    for base in ("dspark", "dspark_rnn", "dflash"):
        for b in s.ablations.block_sizes:
            out.append(base if (b == base_block and base != "dspark_rnn") else f"{base}-b{b}")
    return out
