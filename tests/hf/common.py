"""Tiny transformers models built in the tests (offline), shared by tests/hf."""

from __future__ import annotations

import torch

VOCAB, C, H, HKV, LAYERS = 101, 64, 4, 2, 2


def tiny_config(family: str, **kw):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    args = dict(vocab_size=VOCAB, hidden_size=C, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=H, num_key_value_heads=HKV, head_dim=C // H, max_position_embeddings=128,
                rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    args.update(kw)
    cfg = cls(**args)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(family: str, seed: int = 0, **kw):
    """A random causal LM; initializer_range 0.2 gives peaked attention, so that the tests can fail."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **kw)).eval()
    with torch.no_grad():  # non-trivial family q/k norm gains (Qwen3)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return model
