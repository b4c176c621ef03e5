"""The claim catalogue: every claim a study can register, each declared once, with its measurement beside it.

A claim has an id (``paper.what``), the family its p-value is corrected within by default (its paper's), a
kind (which parameters it takes, ``KINDS``), its text, what is measured, in words, and the measure that
reads it from a study's groups (``study.measures``, ``study.scale_measures``). ``study.plan`` registers
claims from it; ``report.claims`` gives each its verdict. Adding a claim is one entry here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from qklab.fields import at_least, option
from qklab.study.measures import (
    Measure,
    accuracy_control,
    elsewhere,
    less,
    logits_at_same_rate,
    probe_claim,
    stable_rate,
    width_gap,
)
from qklab.study.scale_measures import logit_by_rate, logit_by_width, sensitivity_slope

SIGN_FLIP, GRID, T_TEST = "sign-flip", "grid", "t"
QKMAP_FAMILY, QUACK_FAMILY, SCALE_FAMILY, CONTROL = "QK-MAP", "QuacK", "Scale", "control"
RECENCY_FAMILY = "Recency prior"

# A claim's kind is the parameters it takes: a dataclass, each parameter a field with its default, its
# meaning and its valid values (a range in its metadata, choices as a Literal type), checked as the run
# config's fields are (``config.from_dict`` for types, ``check_fields`` for ranges and choices).
LEVEL = ((lambda v: 0 < v < 1), "a level between 0 and 1, e.g. 0.05")
FAMILY = ((lambda v: bool(v)), "a non-empty name")


@dataclass(frozen=True)
class Tested:
    """A claim tested over paired seeds. ``family`` "" stands for the claim's paper (``Claim.params``)."""

    alpha: float = option(0.05, "the test's level", LEVEL)
    test: Literal["sign-flip"] = option(SIGN_FLIP, "exact sign-flip test over paired seeds")
    family: str = option("", "the family its p-value is corrected within (Holm)", FAMILY)


@dataclass(frozen=True)
class Loss(Tested):
    test: Literal["sign-flip", "t"] = option(SIGN_FLIP, "exact sign-flip test over paired seeds, or the paired "
                                             "t-test (3 seeds: the sign-flip test cannot go below p = 0.25)")
    rate: Literal["tuned"] = option("tuned", "each variant at its tuned rate")
    margin: float = option(0.0, "nats the difference must clear", at_least(0))
    pairing: Literal["best", "same-tau"] = option("best", "the reference's best variant, or the same tau")


@dataclass(frozen=True)
class Probe(Tested):
    rate: Literal["tuned"] = option("tuned", "each variant at its tuned rate")
    margin: float = option(0.0, "the difference must clear", at_least(0))
    context: int = option(0, "tokens probed (0: the training length)", at_least(0))


@dataclass(frozen=True)
class Control:
    """A positive control (report/controls.py): the task is learned at all; no test over seeds, no family."""

    threshold: float = option(0.9, "the accuracy the task must reach", at_least(0))
    context: int = option(0, "tokens probed (0: the training length)", at_least(0))


@dataclass(frozen=True)
class Logits(Tested):
    rate: Literal["highest-shared-stable", "tuned"] = option(
        "highest-shared-stable", "the highest rate where neither diverged, or each at its tuned rate")


@dataclass(frozen=True)
class Stable:
    test: Literal["grid"] = option(GRID, "read on the rate grid")
    stable: Literal["delta", "entropy", "near-best"] = option("delta", "what counts as stable (study.plan)")
    delta: float = option(0.1, "nats from the best rate still counted stable", at_least(0))
    family: str = option("", "the family its p-value is corrected within (Holm)", FAMILY)


@dataclass(frozen=True)
class Width(Tested):
    rate: Literal["tuned"] = option("tuned", "each variant at its tuned rate")


@dataclass(frozen=True)
class Scale(Tested):
    """Across a width ladder, per seed: a slope over the widths (or the rates), paired over seeds; the paired
    t-test is the default, since with 3 seeds the exact sign-flip test cannot go below p = 0.25."""

    test: Literal["t", "sign-flip"] = option(T_TEST, "paired t-test, or the exact sign-flip test")


@dataclass(frozen=True)
class Elsewhere:
    """A claim read in another study: no parameters."""


KINDS: dict[str, type] = {"loss": Loss, "probe": Probe, "control": Control, "logits": Logits, "stable": Stable,
                          "width": Width, "scale": Scale, "elsewhere": Elsewhere}


@dataclass(frozen=True)
class Claim:
    """One claim of the catalogue. ``defaults``: parameters of this claim beyond its kind's; ``own``: a
    study's own claim, listed in a claims table only where a study registers it; ``table_text``: its text
    in a claims table, formatted with its parameters (``text`` is what a registration records)."""

    id: str
    paper: str
    kind: str
    text: str
    measurement: str
    measure: Measure
    defaults: Mapping[str, Any] = field(default_factory=dict)
    own: bool = False
    table_text: str = ""

    def params(self) -> dict[str, Any]:
        """Every parameter at the catalogue's values, its paper as the family."""
        out = {**dataclasses.asdict(KINDS[self.kind]()), **self.defaults}
        if "family" in out:
            out["family"] = self.paper
        return out

    def text_for(self, params: Mapping[str, Any]) -> str:
        return self.table_text.format(**params) if self.table_text else self.text


# (attention, method, controller) of the variants the claims compare
MHA, MLA = "mha", "mla"
QKMAP, STD, QKN = (MHA, "qkmap", "none"), (MHA, "none", "none"), (MHA, "qknorm", "none")
QUACK, MLA_QUACK, MLA_STD = (MHA, "none", "quack"), (MLA, "none", "quack"), (MLA, "none", "none")
ALIBI = (MHA, "alibi", "none")

def _slower(name: str, cid: str, method: str, controller: str = "none", control: bool = False) -> Claim:
    """A scale claim: ``name``'s LR sensitivity grows less with width than `none`'s."""
    text = f"{name}'s learning-rate sensitivity grows less with width than `none`'s"
    return Claim(f"scale.{cid}_sensitivity", SCALE_FAMILY, "scale", f"positive control: {text}" if control else text,
                 f"slope of LR sensitivity against log10 non-embedding parameters, {name} minus `none`, paired over "
                 "seeds (< 0)", sensitivity_slope(method, controller), own=True)


# In table order; a positive control first: it is read before the claims it gates (report/controls.py).
# The scale claims are a study's own about how behaviour changes with scale (Wortsman et al. 2023, arXiv
# 2309.14322). LR sensitivity of a method at a width and seed: the mean over the rate grid of
# min(L(eta), L0) - L*, report-split losses, L0 = ln(vocab) (the loss at initialisation), L* the best over
# the grid (study.sensitivity).
_CLAIMS = [
    Claim("control.retrieval_learned", CONTROL, "control",
          "positive control: Standard attention learns the retrieval task",
          "probe: retrieval accuracy of `none` at its tuned rate, mean over seeds, at the registered context "
          "(default: the training length), against the threshold",
          accuracy_control(STD), own=True),
    Claim("qkmap.val_vs_none", QKMAP_FAMILY, "loss",
          "lower validation loss than Standard attention",
          "report-split loss, paired over seeds",
          less(QKMAP, STD, "report_loss", "report loss")),
    Claim("qkmap.val_vs_qknorm", QKMAP_FAMILY, "loss",
          "lower validation loss than QK-Norm",
          "report-split loss, paired over seeds",
          less(QKMAP, QKN, "report_loss", "report loss")),
    Claim("qkmap.train_vs_none", QKMAP_FAMILY, "loss",
          "lower training loss than Standard attention",
          "mean train loss of the last 10% of steps",
          less(QKMAP, STD, "train_loss", "train loss")),
    Claim("qkmap.train_vs_qknorm", QKMAP_FAMILY, "loss",
          "lower training loss than QK-Norm",
          "mean train loss of the last 10% of steps",
          less(QKMAP, QKN, "train_loss", "train loss")),
    Claim("qkmap.first_token", QKMAP_FAMILY, "loss",
          "less attention on the first token than Standard attention",
          "first-token attention at the last diagnostics step (held-out probe batch)",
          less(QKMAP, STD, "first_token", "first-token attention")),
    Claim("qkmap.val_vs_quest", QKMAP_FAMILY, "loss",
          "lower validation loss than QUEST (keys on the sphere, queries free)",
          "report-split loss, paired over seeds",
          less(QKMAP, (MHA, "quest", "none"), "report_loss", "report loss")),
    Claim("qkmap.first_token_vs_gate", QKMAP_FAMILY, "loss",
          "less attention on the first token than gated attention",
          "first-token attention at the last diagnostics step (held-out probe batch)",
          less(QKMAP, (MHA, "none+gate-head", "none"), "first_token", "first-token attention")),
    Claim("qkmap.input_scale", QKMAP_FAMILY, "probe",
          "keeps sensitivity to input scale (unlike QK-Norm)",
          "probe: attention JS divergence at input scale x4, QK-MAP minus QK-Norm",
          probe_claim("magnitude_js_a4", QKMAP, QKN, higher=True)),
    Claim("qkmap.evidence", QKMAP_FAMILY, "probe",
          "stronger attention contrast on relevant evidence at long context",
          "probe: retrieval evidence log-contrast at the registered context (default: the training length)",
          probe_claim("log_contrast", QKMAP, STD, higher=True)),
    Claim("qkmap.evidence_contrast", QKMAP_FAMILY, "probe",
          "stronger attention contrast on relevant evidence at long context than Standard attention (the "
          "evidence against the whole context)",
          "probe: log-contrast of the queried value's position against every other position the query sees, "
          "at the registered context, QK-MAP minus `none`",
          probe_claim("contrast", QKMAP, STD, higher=True), own=True),
    Claim("qkmap.evidence_contrast_vs_qknorm", QKMAP_FAMILY, "probe",
          "stronger attention contrast on relevant evidence at long context than QK-Norm (the evidence "
          "against the whole context)",
          "probe: log-contrast of the queried value's position against every other position the query sees, "
          "at the registered context, QK-MAP minus QK-Norm",
          probe_claim("contrast", QKMAP, QKN, higher=True), own=True),
    Claim("quack.stable_mha", QUACK_FAMILY, "stable",
          "allows a higher base learning rate than no intervention (MHA)",
          "highest rate of the grid that holds, by the registered stability rule",
          stable_rate(QUACK, STD)),
    Claim("quack.stable_mla", QUACK_FAMILY, "stable",
          "allows a higher base learning rate than no intervention (MLA)",
          "highest rate of the grid that holds, by the registered stability rule",
          stable_rate(MLA_QUACK, MLA_STD)),
    Claim("quack.vs_qkclip_stable_mha", QUACK_FAMILY, "stable",
          "stable where QK-clip diverges at high rates (MHA)",
          "highest rate of the grid that holds, by the registered stability rule",
          stable_rate(QUACK, (MHA, "none", "qkclip"))),
    Claim("quack.vs_qkclip_stable_mla", QUACK_FAMILY, "stable",
          "stable where QK-clip diverges at high rates (MLA)",
          "highest rate of the grid that holds, by the registered stability rule",
          stable_rate(MLA_QUACK, (MLA, "none", "qkclip"))),
    Claim("quack.mla_vs_none", QUACK_FAMILY, "loss",
          "outperforms no intervention in the MLA setting",
          "report-split loss, paired over seeds",
          less(MLA_QUACK, MLA_STD, "report_loss", "report loss")),
    Claim("quack.mla_vs_qknorm", QUACK_FAMILY, "loss",
          "outperforms QK-Normed MLA in the MLA setting",
          "report-split loss, paired over seeds",
          less(MLA_QUACK, (MLA, "qknorm", "none"), "report_loss", "report loss")),
    Claim("quack.mla_vs_qkclip", QUACK_FAMILY, "loss",
          "outperforms QK-clip in the MLA setting",
          "report-split loss, paired over seeds",
          less(MLA_QUACK, (MLA, "none", "qkclip"), "report_loss", "report loss")),
    Claim("quack.competitive_qknorm", QUACK_FAMILY, "loss",
          "competitive with QK-Norm with MHA (not worse by more than the margin)",
          "report-split loss, paired over seeds",
          less(QUACK, QKN, "report_loss", "report loss"), defaults={"margin": 0.05},
          table_text="competitive with QK-Norm with MHA (not worse by more than {margin:g} nats)"),
    Claim("quack.speed", QUACK_FAMILY, "elsewhere",
          "trains faster than QK-Norm (no norms in the block)",
          "step time, interleaved benchmark",
          elsewhere("study cells share the machine, so the CPU time of the same work varies by up to 30% \" "
                    "\"between cells; benchmarks/step_time.py measures it (README, Benchmarks)")),
    Claim("quack.vs_multiplier", QUACK_FAMILY, "loss",
          "better than the fixed-multiplier ablation",
          "report-split loss, paired over seeds (pairing: each at its best, or at the same tau)",
          less(QUACK, (MHA, "none", "qk_lr_multiplier"), "report_loss", "report loss"),
          defaults={"pairing": "same-tau"}),
    Claim("quack.logits_mha", QUACK_FAMILY, "logits",
          "keeps attention logits smaller than no intervention (MHA)",
          "max attention logit at the end, paired ratio (rate: the highest where neither diverged, or each at"
          " its tuned rate)",
          logits_at_same_rate(QUACK, STD)),
    Claim("quack.logits_mla", QUACK_FAMILY, "logits",
          "keeps attention logits smaller than no intervention (MLA)",
          "max attention logit at the end, paired ratio (rate: the highest where neither diverged, or each at"
          " its tuned rate)",
          logits_at_same_rate(MLA_QUACK, MLA_STD)),
    Claim("quack.width_gap", QUACK_FAMILY, "width",
          "its advantage over no intervention grows with width (the paper's argument)",
          "report-loss gap none - quack at the widest minus the narrowest width, paired over seeds",
          width_gap(QUACK, STD)),
    Claim("scale.control_logit_rate", SCALE_FAMILY, "scale",
          "positive control: without a QK method the max attention logit grows with the learning rate",
          "`none`: slope of log10 final max logit against log2 rate over each width's grid, mean over widths,"
          " per seed (> 0)",
          logit_by_rate(), own=True),
    Claim("scale.control_logit_width", SCALE_FAMILY, "scale",
          "positive control: without a QK method the max attention logit grows with width",
          "`none`: slope of log10 final max logit against log10 non-embedding parameters at the highest rate "
          "of the grid that every width shares, per seed (> 0)",
          logit_by_width(), own=True),
    _slower("QK-Norm", "qknorm", "qknorm", control=True),
    _slower("QK-MAP", "qkmap", "qkmap"),
    _slower("QuacK", "quack", "none", "quack"),
    _slower("QUEST", "quest", "quest"),
    # Is QK-MAP's lead the recency prior it starts with (docs/qk-map.md)? ALiBi's bias gives standard
    # attention a known one: a study's own claims, read together (studies/recency_english.toml).
    Claim("recency.alibi_vs_none", RECENCY_FAMILY, "loss",
          "a recency prior alone (ALiBi's bias on RoPE attention) gives lower validation loss than Standard "
          "attention",
          "report-split loss, alibi minus `none`, each at its tuned rate, paired over seeds",
          less(ALIBI, STD, "report_loss", "report loss"), defaults={"test": T_TEST}, own=True),
    Claim("recency.qkmap_vs_alibi", RECENCY_FAMILY, "loss",
          "QK-MAP's lower loss is more than a recency prior: lower validation loss than ALiBi's bias on RoPE "
          "attention",
          "report-split loss, QK-MAP minus alibi, each at its tuned rate, paired over seeds",
          less(QKMAP, ALIBI, "report_loss", "report loss"), defaults={"test": T_TEST}, own=True),
]
CATALOGUE: dict[str, Claim] = {c.id: c for c in _CLAIMS}
