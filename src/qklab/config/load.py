"""Loading a run config: a preset (a packaged name or a TOML path), then ``--set key=value`` items, into a
validated ``RunConfig``; the package's folders of TOML files."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from qklab.config.dotted import parse_set, set_key
from qklab.config.run import RunConfig
from qklab.config.sections import from_dict
from qklab.errors import ConfigError


def packaged(name: str) -> Path:
    """A folder of TOML files shipped inside the package (``presets``, ``studies``), as a path: a wheel
    installs qklab as plain files, so ``importlib.resources`` gives a real folder."""
    return Path(str(resources.files("qklab") / name))


PRESET_DIR = packaged("presets")


def resolve_named_file(spec: str, folder: Path, what: str, kind: str) -> Path:
    """'tiny', 'configs/tiny.toml' or any path -> an existing TOML file: the path as given first, then the
    name in ``folder`` (one of the package's own)."""
    p = Path(spec)
    for cand in (p, folder / p.name, folder / f"{spec}.toml"):
        if cand.is_file():
            return cand
    names = sorted(x.stem for x in folder.glob("*.toml"))
    raise ConfigError(f"{what} '{spec}' not found; give a TOML path or a {kind} name: {', '.join(names)}")


def resolve_preset(spec: str) -> Path:
    return resolve_named_file(spec, PRESET_DIR, "config", "preset")


def preset_names() -> list[str]:
    return sorted(x.stem for x in PRESET_DIR.glob("*.toml"))


def load_config(spec: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    raw = read_preset(spec) if spec else {}
    for item in overrides or []:  # in order: a later item overrides an earlier one
        set_key(raw, *parse_set(item))
    return from_dict(RunConfig, raw).validate()


def read_preset(spec: str) -> dict[str, Any]:
    """A preset (name or TOML path) as the raw nested dict ``from_dict`` reads, ``preset`` set to its stem."""
    path = resolve_preset(spec)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    raw.setdefault("preset", path.stem)
    return raw
