"""Step time of a transformers Llama under ``QKCallback``, against the same model on plain SDPA, in one run.

Every variant is its own copy of one Llama (same init, transformers' ``sdpa`` attention) with its own AdamW,
and a step is what transformers' ``Trainer`` runs per optimizer step, callbacks included: ``on_step_begin``,
forward and backward, ``on_pre_optimizer_step``, ``optimizer.step()``, ``on_optimizer_step``, ``zero_grad``,
and ``on_log`` after every ``--logging-steps``-th step (the loss read then, as the Trainer does). One timed
block is one logging interval, its log included; the variants alternate block by block and each ratio is
the median over rounds of the per-round ratio to plain SDPA (``_timing.py``).

    python benchmarks/hf_callback.py [--rounds 12] [--logging-steps 10] [--variants sdpa,none,quack]

Variants: ``sdpa`` (no callback, the baseline), ``none`` (``QKCallback("none")``: max-logit logging only),
``none-every-step`` (the same, measuring every step: ``every_step=True``), ``quack`` (``QKCallback("quack")``).

Prints JSON: the shape, seconds per step of each variant (median over rounds) and its ratio to ``sdpa``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import warnings

import torch
from _timing import interleaved, paired_ratio

VARIANTS = {"sdpa": None, "none": {"controller": "none"}, "none-every-step": {"controller": "none", "every_step": True},
            "quack": {"controller": "quack", "tau": 0.5}}


def build_model(args):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads // 2, head_dim=args.d_model // args.heads,
                                   max_position_embeddings=args.seq_len, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(args.device).train()


class TrainerSteps:
    """One variant: a model, its optimizer and (or not) a callback, stepped as the Trainer steps them."""

    def __init__(self, model, callback, args, out_dir: str) -> None:
        from transformers import TrainerControl, TrainerState, TrainingArguments

        self.model, self.callback, self.every = model, callback, args.logging_steps
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.targs = TrainingArguments(output_dir=out_dir, logging_steps=args.logging_steps, report_to="none",
                                       use_cpu=True)
        self.state, self.control = TrainerState(), TrainerControl()
        self.state.logging_steps, self.state.max_steps = args.logging_steps, 10**9
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g).to(args.device)
        self._event("on_train_begin", model=model, optimizer=self.opt)

    def _event(self, name: str, **kw) -> None:
        if self.callback is not None:
            getattr(self.callback, name)(self.targs, self.state, self.control, **kw)

    def step(self) -> None:
        self._event("on_step_begin")
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self._event("on_pre_optimizer_step")
        self.opt.step()
        self._event("on_optimizer_step")
        self.opt.zero_grad(set_to_none=True)
        self.state.global_step += 1
        self._event("on_step_end")
        if self.state.global_step % self.every == 0:
            self._event("on_log", logs={"loss": loss.item()})

    def interval(self) -> None:
        for _ in range(self.every):
            self.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--logging-steps", type=int, default=10)
    ap.add_argument("--variants", default="sdpa,none,none-every-step,quack", help="comma-separated; first: baseline")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1, help="untimed logging intervals first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from qklab.hf.callback import QKCallback

    names = args.variants.split(",")
    base = build_model(args)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Trainer here: the callback cannot put itself before its reporters
        runs = {}
        for name in names:
            kw = dict(VARIANTS[name]) if VARIANTS[name] is not None else None
            cb = QKCallback(kw.pop("controller"), **kw) if kw is not None else None
            runs[name] = TrainerSteps(copy.deepcopy(base), cb, args, f"{tmp}/{name}")
        for run in runs.values():
            for _ in range(args.warmup):
                run.interval()
        times = interleaved({k: r.interval for k, r in runs.items()}, args.rounds, 1, torch.device(args.device))
    per_step = {k: statistics.median(v) / args.logging_steps for k, v in times.items()}
    print(json.dumps({
        "shape": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "kv_heads": args.heads // 2,
                  "batch": args.batch, "seq_len": args.seq_len, "vocab": args.vocab},
        "device": args.device, "logging_steps": args.logging_steps, "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "step_s": {k: round(v, 5) for k, v in per_step.items()},
        "ratio": {k: paired_ratio(times[k], times[names[0]]) for k in names[1:]},
    }, indent=2))


if __name__ == "__main__":
    main()
