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


def left_pad(seqs, pad=0):
    """Left-padded ids and attention mask of a batch of 1-D token tensors."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = s
        mask[i, T - len(s):] = 1
    return ids, mask


def check_padded_generation(model) -> None:
    """A left-padded row's logits equal the row alone, and greedy generate() with the cache equals the same
    decoding step by step without it."""
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, 101, (n,), generator=g) for n in (9, 5)]
    ids, mask = left_pad(seqs)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
        alone = model(seqs[1].unsqueeze(0)).logits[0]
        torch.testing.assert_close(padded[1, 4:], alone, atol=1e-4, rtol=1e-4)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
        seq, m = ids.clone(), mask.clone()
        for _ in range(8):
            logits = model(seq, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp_min(0), use_cache=False).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(out, seq)


MODULE_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def _config_attn(name: str, cfg, out: dict) -> None:
    out[name] = cfg._attn_implementation
    for key in getattr(cfg, "sub_configs", {}):
        if getattr(cfg, key, None) is not None:
            _config_attn(f"{name}.{key}", getattr(cfg, key), out)


def snapshot(model, optimizers=()) -> dict:
    """What a qklab handle may touch, comparable with ``assert_same``: the weights; each module's class,
    attribute names and hook counts; every config's attention implementation (sub-configs included); each
    optimizer's step hooks, HeadMuon preconditioners and groups."""
    attn: dict = {}
    _config_attn("config", model.config, attn)
    for name, m in model.named_modules():
        if hasattr(getattr(m, "config", None), "_attn_implementation"):
            _config_attn(f"{name}.config", m.config, attn)
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "modules": {name: (type(m), sorted(vars(m)), [len(getattr(m, h, {})) for h in MODULE_HOOKS])
                    for name, m in model.named_modules()},
        "attn": attn,
        "optimizers": [(len(o._optimizer_step_pre_hooks), len(o._optimizer_step_post_hooks),
                        sorted(getattr(o, "_preconditioners", {})), o.state_dict()["param_groups"])
                       for o in optimizers],
    }


def assert_same(got: dict, want: dict) -> None:
    assert got["weights"].keys() == want["weights"].keys()
    for k, v in want["weights"].items():
        assert torch.equal(got["weights"][k], v), k
    for part in ("modules", "attn", "optimizers"):
        assert got[part] == want[part], part
