"""A qklab GPT to and from a transformers checkpoint folder: Llama (method ``none``) or Qwen3 (``qknorm``,
whose per-head q/k RMSNorm before RoPE is exactly qklab's QK-Norm), plain folders that transformers loads
alone; any other method, option, gate or sink as the Llama ``qklab.hf.apply`` converts (a folder of qklab's
registered twin, loaded by ``AutoModelForCausalLM`` once ``qklab.hf`` is imported). Import reads plain folders.

    export_pretrained(model, "out/", tokenizer=tok)     # config.json, model.safetensors, tokenizer files
    AutoModelForCausalLM.from_pretrained("out/")        # offline; generate() works
    model, tok = import_pretrained("out/")              # back to a qklab GPT (and tokenizer)

Weights keep their values bit for bit both ways; ``LAYER_KEYS`` is the name mapping of one block.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qklab.atomic import follow_umask
from qklab.config import ModelConfig, QKConfig
from qklab.data.tokenizer import EOT_TOKEN, BPETokenizer, ByteTokenizer
from qklab.errors import ConfigError
from qklab.methods import METHODS
from qklab.methods.qknorm import QKNorm, QKNormOptions
from qklab.methods.standard import Standard
from qklab.model import GPT

FAMILY = {"none": "llama", "qknorm": "qwen3"}
# qklab block parameter -> transformers decoder-layer parameter
LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.qk.q_norm.weight": "self_attn.q_norm.weight",
    "attn.qk.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
TOP_KEYS = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}


def plain_family(model: GPT) -> str | None:
    """The transformers family whose plain folder holds ``model`` exactly: "llama" (method none) or "qwen3"
    (QK-Norm with Qwen3's own options); None where the folder needs qklab's twin (any other method or
    option, a gate, a sink), which ``qklab.hf`` loads."""
    cfg, q = model.cfg, model.qk_cfg
    if cfg.attn_gate != "none" or cfg.attn_sink:
        return None
    method = METHODS[q.method]
    if method is Standard:
        return "llama"
    if method is QKNorm and q.opts(q.method) == QKNormOptions(eps=cfg.norm_eps):
        return "qwen3"
    return None


def hf_config(model: GPT):
    """The transformers config of a qklab GPT: Llama or Qwen3 (``plain_family``), else the Llama that
    ``qklab.hf.apply`` converts to the model's method; refuses what has no equivalent (MLA, YaRN)."""
    import transformers

    cfg = model.cfg
    if cfg.attention != "mha":
        raise ConfigError("export covers MHA/GQA models; for MLA layers use qklab.hf.deepseek")
    if cfg.rope_scaling != "none":
        raise ConfigError("export of YaRN RoPE is not supported for transformers folders")
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ff_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                  head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                  rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
                  tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, hidden_act="silu",
                  initializer_range=cfg.init_std)
    if plain_family(model) == "qwen3":
        return transformers.Qwen3Config(use_sliding_window=False, **common)
    return transformers.LlamaConfig(mlp_bias=False, **common)


# a qklab attention parameter -> its name in a layer qklab.hf.apply converted (the twin folders)
TWIN_KEYS = {"attn.qk.": "self_attn.qk_method.", "attn.wg.": "self_attn.attn_gate.", "attn.sink": "self_attn.attn_sink"}


def _layer_key(rest: str, plain: bool) -> str:
    if plain or not rest.startswith(tuple(TWIN_KEYS)):
        return LAYER_KEYS[rest]
    prefix = next(p for p in TWIN_KEYS if rest.startswith(p))
    return TWIN_KEYS[prefix] + rest[len(prefix):]


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """qklab GPT parameters under transformers names (the tied head left out, as transformers saves it)."""
    sd, out, plain = model.state_dict(), {}, plain_family(model) is not None
    for k, v in sd.items():
        if k in TOP_KEYS:
            if k == "lm_head.weight" and model.cfg.tie_embeddings:
                continue
            out[TOP_KEYS[k]] = v
            continue
        _, i, rest = k.split(".", 2)  # blocks.{i}.{rest}
        out[f"model.layers.{i}.{_layer_key(rest, plain)}"] = v
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def export_pretrained(model: GPT, path: str | Path, tokenizer: BPETokenizer | ByteTokenizer | None = None) -> Path:
    """Write ``model`` as a transformers folder: config.json, generation_config.json, the weights and, with
    ``tokenizer``, the tokenizer files (end-of-text as eos and pad). A Llama or Qwen3 folder where one holds
    the model exactly (``plain_family``); otherwise the Llama that ``qklab.hf.apply`` converts to the model's
    method, gate and sink, saved as qklab's twin (``AutoModelForCausalLM`` loads it once ``qklab.hf`` is
    imported). Either way the folder's logits are the model's."""
    import transformers

    cfg = hf_config(model)
    out = Path(path)
    eot = tokenizer.eot_id if tokenizer is not None else None
    cfg.eos_token_id = cfg.pad_token_id = eot
    cfg.bos_token_id = None
    weights = hf_state_dict(model)
    if plain_family(model) is not None:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(out)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        from qklab.hf.apply import apply

        m, q = model.cfg, model.qk_cfg
        hf = transformers.LlamaForCausalLM(cfg)
        apply(hf, q.method, attn_gate=m.attn_gate, attn_sink=m.attn_sink,
              **(dataclasses.asdict(q.opts(q.method)) if q.method != "none" else {}))
        missing, unexpected = hf.load_state_dict(weights, strict=False)
        if unexpected or set(missing) - ({"lm_head.weight"} if m.tie_embeddings else set()):
            raise ConfigError(f"export: the converted Llama does not take the model's weights (missing "
                              f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
        out.mkdir(parents=True, exist_ok=True)
        hf.save_pretrained(out)
    for f in out.glob("model*.safetensors"):
        follow_umask(f)
    transformers.GenerationConfig(eos_token_id=eot, pad_token_id=eot).save_pretrained(out)
    if tokenizer is not None:
        hf_tokenizer(tokenizer).save_pretrained(out)
    return out


def _bytes_tokenizer_object():
    """A tokenizers.Tokenizer whose ids are qklab's byte ids: byte b -> b, end-of-text -> 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # byte-level BPE spells every byte as one printable character; qklab's ids are the byte values
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    vocab = {spelled[b]: b for b in range(256)}
    vocab[EOT_TOKEN] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT_TOKEN])
    return tok


def hf_tokenizer(tokenizer: BPETokenizer | ByteTokenizer):
    """The qklab tokenizer as a transformers fast tokenizer (same ids)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    obj = Tokenizer.from_str(tokenizer.to_json()) if isinstance(tokenizer, BPETokenizer) else _bytes_tokenizer_object()
    return PreTrainedTokenizerFast(tokenizer_object=obj, eos_token=EOT_TOKEN, pad_token=EOT_TOKEN)


def model_config(hf_cfg: dict) -> tuple[ModelConfig, QKConfig]:
    """qklab configs from a Llama/Qwen3 config.json (as a dict)."""
    kind = hf_cfg.get("model_type")
    if kind not in ("llama", "qwen3"):
        raise ConfigError(f"import covers Llama and Qwen3 folders; got model_type '{kind}'")
    rp = hf_cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf_cfg.get("rope_theta", 10000.0)}
    if rp.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_type '{rp['rope_type']}' is not supported by import")
    H, C = hf_cfg["num_attention_heads"], hf_cfg["hidden_size"]
    if hf_cfg.get("head_dim", C // H) != C // H or hf_cfg.get("attention_bias") or hf_cfg.get("mlp_bias"):
        raise ConfigError("import needs head_dim = hidden_size / heads and no attention or MLP biases")
    eps = float(hf_cfg["rms_norm_eps"])
    mc = ModelConfig(vocab_size=hf_cfg["vocab_size"], d_model=C, n_layers=hf_cfg["num_hidden_layers"], n_heads=H,
                     n_kv_heads=hf_cfg.get("num_key_value_heads") or 0, d_ff=hf_cfg["intermediate_size"],
                     max_seq_len=hf_cfg["max_position_embeddings"], rope_theta=float(rp["rope_theta"]),
                     tie_embeddings=bool(hf_cfg.get("tie_word_embeddings", False)), norm_eps=eps,
                     init_std=float(hf_cfg.get("initializer_range", 0.02)))
    if kind == "qwen3":
        return mc, QKConfig(method="qknorm", options={"qknorm": QKNormOptions(eps=eps)})
    return mc, QKConfig()


def import_pretrained(path: str | Path) -> tuple[GPT, BPETokenizer | None]:
    """A qklab GPT (and its BPE tokenizer, when the folder has a tokenizer.json) from a Llama/Qwen3 folder."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder}: no config.json; give a transformers checkpoint folder")
    mc, qk = model_config(json.loads((folder / "config.json").read_text()))
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no model*.safetensors")
    theirs: dict[str, torch.Tensor] = {}
    for f in files:
        theirs.update(load_file(str(f)))
    model = GPT(mc, qk)
    back = {v: k for k, v in TOP_KEYS.items()}
    layer_back = {v: k for k, v in LAYER_KEYS.items()}
    sd = {}
    for k, v in theirs.items():
        if k in back:
            sd[back[k]] = v
            continue
        _, _, i, rest = k.split(".", 3)  # model.layers.{i}.{rest}
        sd[f"blocks.{i}.{layer_back[rest]}"] = v
    if mc.tie_embeddings:
        sd.setdefault("lm_head.weight", sd["tok_emb.weight"])
    model.load_state_dict(sd, strict=True)
    tok_file = folder / "tokenizer.json"  # a byte tokenizer comes back as an equivalent BPE (same ids)
    tok = BPETokenizer.load(tok_file) if tok_file.is_file() else None
    return model.eval(), tok


def export_run_pretrained(path: str | Path, out: str | Path, unverified: bool = False,
                          warn=None) -> tuple[Path, int, str]:
    """``qklab export RUN --hf``: a run folder (or checkpoint) as a transformers folder that loads in a fresh
    process, with the run's tokenizer where the run folder holds it; returns the folder, the checkpoint's step
    and what loads it ("transformers" for a plain Llama/Qwen3 folder, "qklab.hf" for a twin)."""
    from qklab.rundir.load import load_run

    run = load_run(path, unverified=unverified, warn=warn)
    if run.tokenizer is None and warn is not None:
        warn(f"warning: {path} holds no tokenizer.json (a run from before run folders kept it): the folder has "
             "no tokenizer files")
    export_pretrained(run.model, out, tokenizer=run.tokenizer)
    return Path(out), run.step, "transformers" if plain_family(run.model) else "qklab.hf"
