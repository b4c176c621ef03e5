"""Folders that keep their qklab method: ``save_pretrained`` -> ``from_pretrained`` gives back the same model.

``qklab.hf.apply`` records what it did in ``model.config.qklab`` and makes the model and its config qklab's
twins of their family (``model_type`` "qklab_llama", architectures ``["QKLlamaForCausalLM"]``; same weights,
same forward), so ``save_pretrained`` writes a folder that says what it holds. Loading that folder:

* ``qklab.hf.from_pretrained(path, **kwargs)``: always (any ``from_pretrained`` keyword: ``dtype``,
  ``device_map``, ...); a plain transformers folder loads as transformers would load it;
* ``AutoModelForCausalLM.from_pretrained(path)`` once ``qklab.hf`` is imported: qklab registers its model
  types with transformers' Auto classes, as third-party model packages do (when transformers is imported,
  before or after ``qklab.hf``);
* without qklab: transformers refuses the unknown model type ("qklab_llama"); it never loads a silently
  different model.

A model ``apply`` left unchanged (method "none", no gate or sink) stays a plain transformers model and saves
a plain folder. Registration costs no transformers import of its own: the Auto classes get each family's
config twin and a stand-in that builds the model twin (importing the family's modeling code) only when a
folder of that family is loaded.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from typing import Any

from qklab.hf.apply import CLASSES, TWIN_PREFIX, twin_config, twin_model

_registered = False


def _stand_in(family: str) -> type:
    """What the Auto classes hold for a family's model twin: it builds the twin class when first asked."""

    def from_pretrained(cls, *args, **kwargs):
        return twin_model(family).from_pretrained(*args, **kwargs)

    def _from_config(cls, config, **kwargs):
        return twin_model(family)._from_config(config, **kwargs)

    return type(f"QK{CLASSES[family][1]}Loader", (), {
        "config_class": twin_config(family), "__module__": __name__, "__doc__": _stand_in.__doc__,
        "from_pretrained": classmethod(from_pretrained), "_from_config": classmethod(_from_config)})


def register() -> None:
    """Register qklab's model types ("qklab_llama", ...) with ``AutoConfig`` and ``AutoModelForCausalLM``
    (once; imports transformers)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    for family in CLASSES:
        AutoConfig.register(TWIN_PREFIX + family, twin_config(family), exist_ok=True)
        AutoModelForCausalLM.register(twin_config(family), _stand_in(family), exist_ok=True)
    _registered = True


def from_pretrained(path: str | Path, **kwargs: Any):
    """A causal LM from a folder (or hub name) as ``AutoModelForCausalLM.from_pretrained`` loads it, with a
    folder saved after ``qklab.hf.apply`` rebuilt as the model that was saved: same method, same weights."""
    from transformers import AutoModelForCausalLM

    register()
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


class _AfterTransformers(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers qklab's model types right after ``transformers`` itself is imported (when ``qklab.hf`` came
    first), so ``AutoModelForCausalLM.from_pretrained`` knows them in either import order."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # one import of transformers: found by the other finders, its loader wrapped
        spec = next((s for f in sys.meta_path if hasattr(f, "find_spec")
                     for s in [f.find_spec(name, path, target)] if s is not None), None)
        if spec is None or spec.loader is None:
            return spec
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        register()


def register_when_imported() -> None:
    """``register`` now if transformers is imported, else as soon as it is; nothing if it is not installed."""
    if "transformers" in sys.modules:
        register()
    elif importlib.machinery.PathFinder.find_spec("transformers") is not None and \
            not any(isinstance(f, _AfterTransformers) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformers())
