"""``qklab sweep``: the command-line shorthand of a study file.

    qklab sweep --config small --seeds 0,1,2 --out runs/sweeps/qkmap \\
        --variant none:qk.method=none --variant qknorm:qk.method=qknorm \\
        --variant "qkmap-M2:qk.method=qkmap,qk.qkmap.n_freqs=2" --lr-mults 0.5,1,2

is the study ``[study] config/seeds/set`` + one ``[variants.<label>]`` per ``--variant`` + ``[protocol]
lr_mults``, run with the same runner (``qklab.study``): cells in worker processes, finished cells
skipped, failures recorded, results under ``<out>/results`` and a report under ``<out>/report``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qklab.config import ConfigError, parse_sets
from qklab.study.spec import NAME_RE, Study, parse_study


@dataclass
class Variant:
    label: str
    overrides: list[str]  # key=value items


def parse_variant(spec: str) -> Variant:
    """'label:key=value,key=value' -> Variant(label, ['key=value', ...])."""
    label, sep, rest = spec.partition(":")
    if not sep or not label:
        raise ConfigError(f"--variant '{spec}' must look like label:key=value,key=value")
    if not NAME_RE.match(label):
        raise ConfigError(f"--variant '{spec}': the label '{label}' must be a plain name (letters, digits, . _ -)")
    items = [kv for kv in rest.split(",") if kv]
    parse_sets(items, f"--variant '{label}'")
    return Variant(label, items)


def parse_numbers(text: str, what: str, kind: type = int) -> list:
    try:
        vals = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} '{text}' must be a comma-separated list of {kind.__name__}s, e.g. "
                          f"{'0,1,2' if kind is int else '0.5,1,2'}") from None
    if not vals:
        raise ConfigError(f"{what} is empty; give a comma-separated list")
    return vals


def sweep_study(preset: str, variants: list[str], seeds: str, out: str | Path, overrides: list[str],
                lr_mults: str = "1", reference: str | None = None) -> Study:
    parsed = [parse_variant(v) for v in variants]
    vs = {v.label: parse_sets(v.overrides, f"--variant '{v.label}'") for v in parsed}
    if len(vs) != len(variants):
        raise ConfigError("--variant labels must be distinct")
    raw = {"study": {"config": preset, "seeds": parse_numbers(seeds, "--seeds"),
                     "set": parse_sets(overrides, "--set")},
           "variants": vs,
           "protocol": {"lr_mults": parse_numbers(lr_mults, "--lr-mults", float),
                        "reference": reference or next(iter(vs))}}
    name = Path(out).name or "sweep"
    return parse_study(raw, name if NAME_RE.match(name) else "sweep")
