"""Verification policies of the batched engine (core/engine.py): how many of each
request's draft tokens the round's target forward verifies (paper Sec. 3.2).

* `FixedGamma` - every drafted token (the paper's Table 1 setting);
* `StaticThreshold` - cut each proposal at the first position with
  sigma(c_k) < threshold (the reference's rule, Figure 5);
* `LiveAlgorithm1` - Algorithm 1 each round: this round's confidences of every
  active request (STS-calibrated when temperatures are given) and the engine's
  SPS(B) curve go to `scheduler.schedule_prefix`, which picks l_r greedily with
  the non-anticipating early stop. The confidences exist before any token of
  the round is verified, so the choice never looks at the verification outcome
  (Appendix A's property holds by construction); verification of the chosen
  prefix is the same rejection sampling, so every policy is lossless.

A policy maps the round's per-request proposals (`decode.Proposal`: tokens
[1, g], probs, conf logits [1, g] or None) to lengths l_r.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import DeepSpecError
from .decode import proposal_length
from .scheduler import SPSLike, schedule_prefix, sps_fn


class FixedGamma:
    """Every drafted token, or the first `length` of them."""

    name = "fixed"

    def __init__(self, length: Optional[int] = None):
        self.length = length

    def lengths(self, props) -> list[int]:
        return [int(p.tokens.shape[1]) if self.length is None else min(int(self.length), int(p.tokens.shape[1]))
                for p in props]


class StaticThreshold:
    name = "threshold"

    def __init__(self, threshold: float):
        self.threshold = float(threshold)

    def lengths(self, props) -> list[int]:
        return [int(proposal_length(p, self.threshold)) for p in props]


class LiveAlgorithm1:
    """Algorithm 1 online. `sps` is the engine's SPS(B) curve (profiled at start-up
    or read from CSV); `temperatures` [gamma] are STS temperatures (None: raw
    sigmoid). Drafters without a confidence head need `default_confidence`, a
    constant c used at every position (e.g. the drafter's measured acceptance)."""

    name = "alg1"

    def __init__(self, sps: SPSLike, temperatures: Optional[Sequence[float]] = None, early_stop: bool = True,
                 default_confidence: Optional[float] = None):
        self.sps, self.early_stop = sps, early_stop
        self.temperatures = None if temperatures is None else np.asarray(temperatures, dtype=np.float64)
        self.default_confidence = default_confidence

    def confidences(self, props) -> np.ndarray:
        """c [R, gamma_max]: calibrated conditional confidences, 0 past a row's proposal."""
        g = max(int(p.tokens.shape[1]) for p in props)
        c = np.zeros((len(props), g))
        for r, p in enumerate(props):
            n, conf = p.tokens.shape[1], p.conf_logits
            if conf is None:
                if self.default_confidence is None:
                    raise DeepSpecError("Algorithm 1 needs confidences: this drafter has no confidence head "
                                        "(give a default_confidence)")
                c[r, :n] = self.default_confidence
                continue
            x = conf[0, :n].float().cpu().double().numpy()
            t = np.ones(n) if self.temperatures is None else self.temperatures[:n]
            c[r, :n] = torch.sigmoid(torch.from_numpy(x / t)).numpy()
        return c

    def lengths(self, props) -> list[int]:
        ell, _ = schedule_prefix(self.confidences(props), self.sps, early_stop=self.early_stop)
        return [int(x) for x in ell]

    def stop_after(self, conf_logits: torch.Tensor) -> bool:
        """One request's drafting may end at position k (conf_logits [1, k], the
        confidence logits so far): with the early stop its scan visits positions in
        order and never looks past the first it rejects, so when it does not verify
        all k, the length it picks from these k is the one it would pick from the
        whole block, and the rest need not be drafted."""
        from .decode import Proposal

        k = conf_logits.shape[1]
        prop = Proposal(tokens=conf_logits.new_zeros(1, k, dtype=torch.long), probs=None, conf_logits=conf_logits)
        return self.early_stop and self.lengths([prop])[0] < k


class PaddedAlgorithm1(LiveAlgorithm1):
    """Algorithm 1's objective for the padded engine (core/engine.py): a round costs
    R(1 + max l_r) tokens whatever the other rows verify, so every row verifies the
    same width w (up to its own proposal), and w maximises
    Theta(w) = sum_r (1 + sum_{j<=w} a_{r,j}) * SPS(R(1 + w)), a_{r,j} = prod_{i<=j} c_{r,i},
    the smallest w on ties. Same confidences and SPS curve as `LiveAlgorithm1` (the
    curve `profile_engine_sps` measures is exactly SPS(R(1 + w))); non-anticipating
    and lossless like it."""

    name = "alg1-padded"

    def lengths(self, props) -> list[int]:
        c = self.confidences(props)
        R, g = c.shape
        a, f = np.cumprod(c, axis=1), sps_fn(self.sps)
        theta = [(R + a[:, :w].sum()) * f(R * (1 + w)) for w in range(g + 1)]
        w = int(np.argmax(theta))
        return [min(w, int(p.tokens.shape[1])) for p in props]
