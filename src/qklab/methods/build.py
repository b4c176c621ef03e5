"""A method or controller by name, with keyword options: the one place that turns a name and options
into an ``Options`` dataclass, checked, with the one-line ``ConfigError`` a user sees."""

from __future__ import annotations

import dataclasses

from qklab.errors import ConfigError
from qklab.methods import CONTROLLERS, METHODS


def method_options(method: str, options: dict, controller: bool = False) -> object:
    """The Options dataclass of a forward-side method (``controller``: an optimizer-side controller) from
    keyword options, checked; a name of the other kind is one line saying which call takes it."""
    want, other = (CONTROLLERS, METHODS) if controller else (METHODS, CONTROLLERS)
    if method not in want:
        hint = ((f"; '{method}' is a forward-side method: qklab.hf.apply(model, '{method}'), or qklab.QK in your "
                 "own attention" if controller else
                 f"; '{method}' is an optimizer-side controller: qklab.attach(model, optimizer, '{method}')")
                if method in other else "")
        raise ConfigError(f"unknown QK {'controller' if controller else 'method'} '{method}'; choose one of "
                          f"{', '.join(sorted(want))}{hint}")
    cls = want[method].Options
    known = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(options) - known)
    if bad:
        raise ConfigError(f"{method} has no option {', '.join(bad)}; known: {', '.join(sorted(known)) or 'none'}")
    try:
        opts = cls(**options)
        if hasattr(opts, "validate"):
            opts.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return opts
