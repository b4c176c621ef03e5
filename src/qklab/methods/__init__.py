"""Registry of QK methods. Adding a method: one file plus one line here."""

from __future__ import annotations

from qklab.methods.alibi import ALiBi
from qklab.methods.base import AttnShape, QKController, QKMethod
from qklab.methods.compositional import Compositional
from qklab.methods.qk_lr_multiplier import QKLRMultiplier
from qklab.methods.qkclip import QKClip
from qklab.methods.qkguard import QKGuard
from qklab.methods.qkmap import QKMap
from qklab.methods.qknorm import QKNorm
from qklab.methods.quack import QuacK
from qklab.methods.quest import Quest
from qklab.methods.softcap import SoftCap
from qklab.methods.ssmax import SSMax
from qklab.methods.standard import Standard
from qklab.methods.upper_qk_slowdown import UpperQKSlowdown

# forward-side: name -> QKMethod subclass
METHODS: dict[str, type[QKMethod]] = {
    "none": Standard,
    "qknorm": QKNorm,
    "softcap": SoftCap,
    "qkmap": QKMap,
    "quest": Quest,
    "ssmax": SSMax,
    "qkguard": QKGuard,
    "alibi": ALiBi,
}

# optimizer-side: name -> QKController subclass
CONTROLLERS: dict[str, type[QKController]] = {
    "none": QKController,
    "quack": QuacK,
    "qkclip": QKClip,
    "qk_lr_multiplier": QKLRMultiplier,
    "compositional": Compositional,
    "upper_qk_slowdown": UpperQKSlowdown,
}
# the controllers' per-head factor series (QKController.head_series_prefix): metrics prefix -> series name
HEAD_SERIES: dict[str, str] = {c.head_series_prefix: c.head_series_prefix.rstrip("_")
                               for c in CONTROLLERS.values() if c.head_series_prefix}

__all__ = ["METHODS", "CONTROLLERS", "HEAD_SERIES", "AttnShape", "QKMethod", "QKController"]
