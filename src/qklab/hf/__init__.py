"""qklab's methods on other people's models.

* ``apply(model, method, attn_gate=..., attn_sink=..., **options)``: a forward-side method (qknorm, qkmap,
  quest, ssmax, softcap, alibi), and optionally the attention gate (``"head"`` or ``"element"``) and a learnable
  per-head sink logit, in every attention layer of a transformers Llama / Mistral / Qwen2 / Qwen3 causal LM.
* ``attach(model, optimizer, controller, **options)``: an optimizer-side controller (quack, qkclip,
  qk_lr_multiplier, compositional) on any PyTorch model (``qklab.attach`` is the same function).
* ``QKCallback``: the controllers and per-head max-logit logging under transformers' ``Trainer``.
* ``from_pretrained(path)``: a folder saved after ``apply`` loads back as the same model (so does
  ``AutoModelForCausalLM.from_pretrained`` once ``qklab.hf`` is imported: ``pretrained.register``).
* DeepSeek-V2/V3 MLA weights to and from qklab's MLA; a qklab GPT to and from a Llama / Qwen3 folder.

Only the functions that build or read transformers objects import ``transformers`` (the ``hf`` extra).
"""

from __future__ import annotations

from qklab.hf.apply import apply
from qklab.hf.attach import Attached, attach
from qklab.hf.deepseek import load_deepseek_attention, mla_config, mla_from_deepseek, save_deepseek_attention
from qklab.hf.export import export_pretrained, import_pretrained
from qklab.hf.layers import LayerSpec, QKLayer, find_layers
from qklab.hf.pretrained import from_pretrained, register, register_when_imported

__all__ = ["apply", "attach", "Attached", "LayerSpec", "QKLayer", "find_layers", "QKCallback", "mla_config",
           "mla_from_deepseek", "load_deepseek_attention", "save_deepseek_attention", "export_pretrained",
           "import_pretrained", "from_pretrained", "register"]

register_when_imported()


def __getattr__(name: str):
    if name == "QKCallback":  # subclasses transformers.TrainerCallback: import transformers only when asked
        from qklab.hf.callback import QKCallback

        return QKCallback
    raise AttributeError(f"module 'qklab.hf' has no attribute '{name}'")
