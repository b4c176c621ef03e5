"""QK-MAP: a magnitude-aware periodic projection for queries and keys (reconstructed; docs/qk-map.md).

Variant "post" (default), per head, on z = W x in R^{d'} (the query or key before the map):

    phi(z) = [cos(w_m z_i) ..., sin(w_m z_i) ...]     i = 1..d', m = 1..M      (width F = 2 M d')

laid out as [all cosines | all sines], so that with the "rotate half" RoPE each (cos, sin) of one
(i, m) is one rotary pair. Every pair has length 1, so ||phi(z)|| = sqrt(M d') for every z (fixed
norm), and the logit of a query head h with per-head temperature T_h is

    s = T_h / (M d') * phi(q) . phi(k) = T_h * mean_{i,m} cos(w_m (q_i - k_i))    (RoPE after the map
                                                                                 adds the position phase)

so |s| <= |T_h| (bounded), and s depends on q - k, so scaling the input changes the pattern
(magnitude-sensitive). T_h / (M d') is folded into phi(q); the softmax scale is 1.

Variants: "input" maps the normalised attention input x instead (then linear Q/K projections and
standard 1/sqrt(d) scaling); "polar" maps direction and magnitude separately,
phi(z) = (z / ||z||) (x) [cos(w_m g(||z||)), sin(w_m g(||z||))] with g = identity or log.

Frequencies w > 0 are stored as log w: one set per layer, per KV head, or per KV head and coordinate
(``sharing``); a query head uses the frequencies of its KV head so that q and k share one spectrum.
The temperature is stored as log T_h, so it stays positive and moves by a relative amount per step.
Both live in their own optimizer group (``param_group``): no weight decay, rate ``map_lr_scale`` times the
base rate (``qklab.train.optim``).

Init rule (``docs/qk-map.md`` lists the measured starting logit statistics of each variant):
* post/polar: W_Q/W_K ~ N(0, 1/fan_in), so each z_i has std ~1 on RMS-normalised input and the phase
  w * z_i has std ~w; frequencies on a log grid from ``freq_min``; T_h = ``temperature``.
* input: features sqrt(2) [cos(w x) | sin(w x)] have RMS exactly 1, like the normalised hidden state
  they replace, and W_Q/W_K start at the model's init_std, so the logits start as standard attention's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from qklab.fields import above, at_least, option
from qklab.methods.base import AttnShape, QKMethod
from qklab.methods.options import Options


@dataclass
class QKMapOptions(Options, section="qk.qkmap"):
    variant: Literal["post", "input", "polar"] = option("post", "where the periodic map acts (docs/qk-map.md)")
    n_freqs: int = option(1, "M, frequencies per coordinate", at_least(1))
    proj_dim: int = option(0, "d' per head (post/polar); 0: compute-matched, 2 M d' = d_head", at_least(0))
    freq_min: float = option(0.5, "frequencies start on a log grid from freq_min ...", above(0))
    freq_max: float = option(0.0, "... to freq_max; 0: freq_min * 2^(M-1)", at_least(0))
    sharing: Literal["auto", "layer", "head", "coord"] = option(
        "auto", "who shares frequencies: auto (head; layer for input), coord (post only)")
    learn_freqs: bool = option(True, "the frequencies are learnt (as log_freq)")
    temperature: float = option(0.0, "initial logit bound T_h (post/polar); 0: 2 sqrt(d_head) (docs/qk-map.md)",
                                at_least(0))
    learn_temperature: bool = option(True, "T_h is learnt as log T_h")
    map_lr_scale: float = option(10.0, "rate of log_freq and log_temp relative to the base rate (no weight "
                                 "decay)", at_least(0), was="lr_mult")
    rope: Literal["after", "before"] = option("after", "after: RoPE on (cos, sin) pairs; before: RoPE on z, then the "
                                                       "map (ablation)")
    polar_g: Literal["identity", "log"] = option("log", "polar only: the norm as it is, or its log")
    qk_init_std: float = option(0.0, "std of W_Q/W_K at init; 0: post/polar 1/sqrt(fan_in) (w * std(z) ~ w), input "
                                     "the model's init_std", at_least(0))

    def check(self) -> None:
        if self.variant == "input" and self.sharing in ("head", "coord"):
            raise ValueError(f"qk.qkmap.sharing={self.sharing} needs variant post or polar (input maps x before "
                             "the heads exist); use sharing=layer or auto")
        if self.variant == "polar" and self.sharing == "coord":
            raise ValueError("qk.qkmap.sharing=coord needs variant post (polar has one magnitude phase per head, "
                             "no per-coordinate phases); use sharing=head or layer")
        if self.variant == "input" and self.rope == "before":
            raise ValueError("qk.qkmap.rope=before needs variant post or polar (input maps x, before any RoPE)")

    def groups_mode(self) -> str:
        """The effective sharing: auto is per head, or per layer for the input variant."""
        if self.sharing == "auto":
            return "layer" if self.variant == "input" else "head"
        return self.sharing


def periodic(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """z (..., d), w broadcastable to (..., d, M) -> [cos(w z) | sin(w z)] (..., 2 M d), in fp32."""
    ph = (z.float().unsqueeze(-1) * w).flatten(-2)  # (..., d * M)
    return torch.cat([ph.cos(), ph.sin()], dim=-1)


class QKMap(QKMethod):
    name = "qkmap"
    Options = QKMapOptions
    latent_cache_ok = False  # a nonlinear map of k: an MLA latent cache cannot hold it

    def __init__(self, shape: AttnShape, opts: QKMapOptions) -> None:
        super().__init__(shape, opts)
        M, hd = opts.n_freqs, shape.head_dim
        if opts.variant == "input":
            self.d = shape.d_model  # the map acts on x
        else:
            self.d = opts.proj_dim or hd // (2 * M)
            if self.d < 1 or (opts.proj_dim == 0 and 2 * M * self.d != hd):
                raise ValueError(f"qk.qkmap: compute-matched needs head_dim={hd} divisible by 2*n_freqs={2 * M}; "
                                 "set qk.qkmap.proj_dim or n_freqs")
        if opts.rope == "before" and self.d % 2:
            raise ValueError(f"qk.qkmap.rope=before needs an even proj_dim, got {self.d}")
        opts.validate()  # refuse combinations that cannot run, also when built outside RunConfig
        sharing = opts.groups_mode()
        groups = {"layer": 1, "head": shape.n_kv_heads, "coord": shape.n_kv_heads}[sharing]
        coords = self.d if sharing == "coord" else 1
        self.log_freq = nn.Parameter(torch.zeros(groups, coords, M), requires_grad=opts.learn_freqs)  # (G, d|1, M)
        learn_t = opts.learn_temperature and opts.variant != "input"  # input uses the 1/sqrt(d) scale, no T_h
        self.log_temp = nn.Parameter(torch.zeros(shape.n_heads), requires_grad=learn_t)  # (H,): log T_h
        self._seen: dict[str, torch.Tensor] = {}
        self.reset_parameters()

    # --- shapes -----------------------------------------------------------------------------------
    def proj_dim(self) -> int:
        return self.shape.head_dim if self.opts.variant == "input" else self.d

    def feature_dim(self) -> int:
        if self.opts.variant == "input":
            return self.shape.head_dim
        return 2 * self.opts.n_freqs * self.d

    def qk_in_dim(self) -> int:
        return 2 * self.opts.n_freqs * self.shape.d_model if self.opts.variant == "input" else self.shape.d_model

    def qk_init_std(self, default: float) -> float:
        if self.opts.qk_init_std:
            return self.opts.qk_init_std
        return default if self.opts.variant == "input" else 1.0 / math.sqrt(self.qk_in_dim())

    @torch.no_grad()
    def clip_logits(self, g: torch.Tensor) -> bool:
        """post/polar: the logits are T_h times a bounded kernel, so QK-clip scales T_h by g_h (exact);
        input: the logits scale with W_Q W_K as in standard attention."""
        if self.opts.variant == "input":
            return False
        self.log_temp.add_(g.to(self.log_temp).log())
        return True

    def param_group(self) -> tuple[str, float] | None:
        """The optimizer group of the map's own parameters: (name, rate multiplier), no weight decay."""
        return "qk_map", self.opts.map_lr_scale

    @torch.no_grad()
    def reset_parameters(self) -> None:
        o = self.opts
        fmax = o.freq_max or o.freq_min * 2.0 ** (o.n_freqs - 1)
        n = self.log_freq[0].numel()  # frequencies of one group, spread on a log grid
        lo, hi = math.log(o.freq_min), math.log(fmax)
        grid = torch.linspace(lo, hi, n) if n > 1 else torch.tensor([lo])
        # (d|1, M): for coord sharing, coordinate i gets the i-th block of M grid points
        self.log_freq.copy_(grid.view(self.log_freq.shape[1:]).expand_as(self.log_freq))
        self.log_temp.fill_(math.log(o.temperature or 2.0 * math.sqrt(self.shape.head_dim)))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        old = state_dict.pop(prefix + "temp", None)  # weights saved before the log temperature: T_h itself
        if old is not None and prefix + "log_temp" not in state_dict:
            state_dict[prefix + "log_temp"] = old.abs().clamp_min(1e-6).log()  # |s| <= |T_h| was the bound
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def freqs(self) -> torch.Tensor:
        return self.log_freq.exp()  # (G, d|1, M)

    def temperature(self) -> torch.Tensor:
        return self.log_temp.exp()  # (H,): the logit bound T_h

    # --- the map ----------------------------------------------------------------------------------
    def map_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.opts.variant != "input":
            return x
        if self.record:
            self._keep(x.unsqueeze(1), x.unsqueeze(1))  # one "head": the phases are w * x_c
        w = self.freqs()[0]  # (1, M): shared by all heads
        feats = periodic(x, w) * math.sqrt(2.0)  # (B, T, 2 M C), RMS exactly 1
        return feats.to(x.dtype)

    def _phi(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, Hz, T, d) for Hz query or KV heads -> features (B, Hz, T, F), unit pairs."""
        w = self.freqs()  # (G, d|1, M)
        G, Hz = w.shape[0], z.shape[1]
        w = w.repeat_interleave(Hz // G, dim=0) if G > 1 else w  # (Hz|1, d|1, M); q heads follow their KV head
        w = w.unsqueeze(1)  # (Hz|1, 1, d|1, M) against z (B, Hz, T, d, 1)
        if self.opts.variant == "post":
            return periodic(z, w)
        # polar: direction (x) phase of the magnitude
        zf = z.float()
        r = zf.norm(dim=-1, keepdim=True)  # (B, Hz, T, 1)
        u = zf / r.clamp_min(1e-12)  # direction, (B, Hz, T, d)
        u = torch.where(r > 0, u, torch.full_like(u, 1.0 / math.sqrt(z.shape[-1])))  # z = 0: a fixed direction
        g = torch.log(r.clamp_min(1e-12)) if self.opts.polar_g == "log" else r
        ph = (g.unsqueeze(-1) * w).squeeze(-2)  # (B, Hz, T, M)
        c, s = ph.cos().unsqueeze(-2), ph.sin().unsqueeze(-2)  # (B, Hz, T, 1, M)
        return torch.cat([(u.unsqueeze(-1) * c).flatten(-2), (u.unsqueeze(-1) * s).flatten(-2)], dim=-1)

    def map_qk(self, q, k, rope, pos):
        # q: (B, H, T, d'), k: (B, Hkv, T, d')
        if self.opts.variant == "input":
            return rope(q, pos), rope(k, pos)
        if self.opts.rope == "before":
            q, k = rope(q, pos), rope(k, pos)
        if self.record:
            self._keep(q, k)
        # ||phi||^2: M d' unit pairs (post), or a unit direction times M unit pairs (polar)
        norm2 = self.feature_dim() // 2 if self.opts.variant == "post" else self.opts.n_freqs
        fq = self._phi(q) * (self.temperature().view(1, -1, 1, 1) / norm2)  # (B, H, T, F): |logit| <= T_h
        fk = self._phi(k)  # (B, Hkv, T, F)
        if self.opts.rope == "after":
            fq, fk = rope(fq, pos), rope(fk, pos)
        return fq.to(q.dtype), fk.to(k.dtype)

    def scale(self, feature_dim: int) -> float:
        return 1.0 / math.sqrt(feature_dim) if self.opts.variant == "input" else 1.0

    def after_rope_refusal(self) -> str:
        if self.opts.variant == "input":
            return ""  # it maps x before the projections; q and k are only rotated
        return ("qkmap must sit before RoPE (its periodic map of q and k does not commute with the rotation, and RoPE "
                "turns the map's (cos, sin) pairs): call qk(q, k) on the projections' outputs")

    # --- stability signals ------------------------------------------------------------------------
    @torch.no_grad()
    def _keep(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Per-head moments of what the frequencies multiply (q, k: (B, Hz, T, d)): the coordinates
        (post, input) or g(||z||) (polar), and the pre-map norms."""
        def phase_var(z):
            z = z.float()
            if self.opts.variant == "polar":
                r = z.norm(dim=-1, keepdim=True).clamp_min(1e-12)
                return r.log() if self.opts.polar_g == "log" else r  # (B, Hz, T, 1)
            return z
        pq, pk = phase_var(q), phase_var(k)
        self._seen = {"q_mean": pq.mean(dim=(0, 2)), "q_var": pq.var(dim=(0, 2), correction=0),  # (Hz, d|1)
                      "k_mean": pk.mean(dim=(0, 2)), "k_var": pk.var(dim=(0, 2), correction=0),
                      "q_norm": q.float().norm(dim=-1).mean(dim=(0, 2)),
                      "k_norm": k.float().norm(dim=-1).mean(dim=(0, 2))}

    @torch.no_grad()
    def stats(self) -> dict[str, list[float]]:
        """Per query head (one entry per layer for ``input``), from the last forward with ``record`` on:

        * ``w_std``: max_m mean_i w_m std(z_i), the phase scale of the queries (about 1 or below: the
          logit is close to a dot product; well above: the frequency gradient, which grows with q - k,
          gets large);
        * ``phase_spread``: max_m mean_i w_m rms(q_i - k_i) over independent (query, key) pairs with the
          head's key head;
        * ``aliased``: share of (i, m) with w_m rms(q_i - k_i) > pi (phases that wrap: aliasing);
        * ``q_norm``, ``k_norm``: mean pre-map ||q||, ||k|| (the magnitude signal; post-map norms are
          constant by design); ``temperature``: T_h.
        Empty before a recorded forward."""
        if not self._seen:
            return {}
        s = self._seen
        Hq, Hk = s["q_mean"].shape[0], s["k_mean"].shape[0]
        rep = lambda t: t.repeat_interleave(Hq // Hk, dim=0)  # noqa: E731 -- key head of each query head
        w = self.freqs().detach()  # (G, d|1, M)
        w = w.repeat_interleave(Hq // w.shape[0], dim=0) if w.shape[0] > 1 else w.expand(Hq, *w.shape[1:])
        w_std = (w * s["q_var"].sqrt().unsqueeze(-1)).mean(dim=1).amax(dim=-1)  # (Hq,)
        rms = (s["q_var"] + rep(s["k_var"]) + (s["q_mean"] - rep(s["k_mean"])) ** 2).sqrt()  # (Hq, d|1)
        ph = w * rms.unsqueeze(-1)  # (Hq, d|1, M)
        out = {"w_std": w_std, "phase_spread": ph.mean(dim=1).amax(dim=-1),
               "aliased": (ph > math.pi).float().flatten(1).mean(dim=1),
               "q_norm": s["q_norm"], "k_norm": rep(s["k_norm"])}
        if self.opts.variant != "input":
            out["temperature"] = self.temperature().detach()
        return {k: v.tolist() for k, v in out.items()}
