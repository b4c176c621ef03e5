"""qklab's methods on other people's models.

* ``apply(model, method, **options)``: a forward-side method (qknorm, qkmap, softcap) in every attention
  layer of a transformers Llama / Mistral / Qwen2 / Qwen3 causal LM.
* ``attach(model, optimizer, controller, **options)``: an optimizer-side controller (quack, qkclip,
  qk_lr_multiplier) on any PyTorch model (``qklab.attach`` is the same function).
* ``QKCallback``: the controllers and per-head max-logit logging under transformers' ``Trainer``.
* DeepSeek-V2/V3 MLA weights to and from qklab's MLA; a qklab GPT to and from a Llama / Qwen3 folder.

Only the functions that build or read transformers objects import ``transformers`` (the ``hf`` extra).
"""

from __future__ import annotations

from qklab.hf.apply import apply

__all__ = ["apply"]
