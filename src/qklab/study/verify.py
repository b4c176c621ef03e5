"""``qklab study verify``: retrain committed cells from the configs they record and compare every number
bit for bit ("reproducible from committed results"): the training numbers, and the attention probes when
the result has them. The recorded config must hash to the cell hash the result names; a cell trained by
another code version than the one verifying it is named (numbers may then differ for that reason)."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qklab.config import ConfigError, RunConfig
from qklab.study.cell import DONE
from qklab.study.result import (
    build_result,
    load_result,
)

VERIFIED_KEYS = ("status", "diverged", "divergence", "corpus", "n_params", "unigram_entropy", "final",
                 "best_val_loss", "curves", "heads", "head_series", "spikes", "nonfinite_steps")


@dataclass
class Verdict:
    cell: str
    same: bool
    differences: list[str] = field(default_factory=list)  # 'final.report_loss: 4.43 here, 4.4300000000000001 committed'
    note: str = ""  # on a difference: where the two ran, and how far apart the final losses ended
    added: list[str] = field(default_factory=list)  # paths only the retrained result holds: not compared


def _hardware(m: dict[str, Any]) -> tuple:
    """The machine's kind: its CPU, the kernels PyTorch dispatches to, the GPU."""
    return tuple(m.get(k) for k in ("cpu", "cpu_capability", "gpu"))


def _kind(m: dict[str, Any]) -> tuple:
    """What a machine's floats depend on: its kind and its thread count."""
    return (*_hardware(m), m.get("threads"))


def _describe(m: dict[str, Any]) -> str:
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    return f"{m.get('cpu')} ({m.get('cpu_capability')}, {m.get('threads')} thread(s){gpu})"


@functools.cache
def _machine_here(device: str) -> dict[str, Any] | None:
    """This machine as a run on ``device`` records it (None: a CUDA device this machine lacks)."""
    from qklab.train.startup import machine, pick_device

    try:
        return machine(pick_device(device))
    except ConfigError:
        return None


def _trained_here(res: dict[str, Any]) -> bool:
    """Whether every machine a committed cell records is of this machine's kind (the thread count is the
    cell's own, set again when it is retrained): where bit for bit is expected."""
    recorded = res.get("machines")
    here = _machine_here(str(((res.get("config") or {}).get("train") or {}).get("device", "auto")))
    return (isinstance(recorded, list) and bool(recorded) and here is not None
            and all(isinstance(m, dict) and _hardware(m) == _hardware(here) for m in recorded))


def machine_note(committed: Any, retrained: Any, new: dict[str, Any], old: dict[str, Any]) -> str:
    """Why two runs of one config may differ although the code is the same: the machines they ran on (a
    cell recorded before results named their machine says so), and the size of the difference at the end
    (report-split loss), to read against the seed-to-seed spread."""
    here = (retrained or [{}])[-1]
    if not committed:
        where = ("the committed cell does not record its machine (results from before `machines` was recorded); "
                 f"retrained on {_describe(here)}")
    elif all(_kind(m) == _kind(here) for m in committed):
        where = f"the same kind of machine ({_describe(here)}): not a machine difference"
    else:
        where = (f"trained on {'; '.join(_describe(m) for m in committed)}, retrained on {_describe(here)}: "
                 "float kernels differ between machines, so bit for bit is not expected across them")
    a, b = ((new.get("final") or {}).get("report_loss"), (old.get("final") or {}).get("report_loss"))
    gap = (f"; final report loss {a:.4f} retrained, {b:.4f} committed ({a - b:+.3g})"
           if isinstance(a, float) and isinstance(b, float) else "")
    return where + gap


def _canonical(v: Any) -> str:
    from qklab.study.result import _finite

    return json.dumps(_finite(v), sort_keys=True)


def _differences(new: Any, old: Any, added: list[str], path: str = "") -> list[str]:
    """Where two JSON values differ, by path (floats compared by their exact repr: bit for bit). A key only
    the retrained result holds (a measurement added to the code after the cell was committed) cannot be
    compared: its path goes to ``added``, not among the differences; a key only the committed result holds is one."""
    if isinstance(new, dict) and isinstance(old, dict):
        out = []
        for k in sorted(set(new) | set(old), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in new:
                out.append(f"{p}: missing here")
            elif k not in old:
                added.append(p)
            else:
                out += _differences(new[k], old[k], added, p)
        return out
    if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
        return [d for i, (a, b) in enumerate(zip(new, old, strict=True))
                for d in _differences(a, b, added, f"{path}[{i}]")]
    a, b = _canonical(new), _canonical(old)
    return [] if a == b else [f"{path}: {a[:60]} retrained, {b[:60]} committed"]


def _probe_mult(res: dict[str, Any], cfg: RunConfig, results: Path | None) -> int:
    """The probe contexts the study used, in training lengths: its study.json's [protocol] probe, else the
    longest retrieval context the committed probe holds."""
    from qklab.study.result import read_json

    if results is not None:
        sj, problem = read_json(results / "study.json")
        n = (sj.get("protocol") or {}).get("probe") if problem is None and isinstance(sj, dict) else None
        if type(n) is int and n > 0:
            return n
    lengths = [int(r["length"]) for r in (res.get("probe") or {}).get("retrieval") or [] if r.get("length")]
    return max(1, -(-max(lengths, default=cfg.train.seq_len) // cfg.train.seq_len))


def _hash_problem(res: dict[str, Any], cfg: RunConfig) -> list[str]:
    from qklab.study.spec import cell_hash, legacy_cell_hash

    named = res.get("cell_hash")
    # a result records the vocabulary size the data resolved; the study's config has 0 ("from the data")
    auto = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=0))
    if named is None or named in {h(c) for c in (cfg, auto) for h in (cell_hash, legacy_cell_hash)}:
        return []
    return [f"cell_hash: the recorded config hashes to {cell_hash(cfg)}, the result names {named}"]


def verify_cell(res: dict[str, Any], out: Path, log=print, results: Path | None = None) -> Verdict:
    """Train the cell of a committed result again from the config it records (its thread count included,
    in ``out``) and compare what the result holds, number for number, its probes included."""
    from qklab.config import from_dict
    from qklab.data import prepare_data, unigram_entropy
    from qklab.diagnostics.stability import NonFiniteError
    from qklab.rundir.metrics import read_metrics
    from qklab.train.trainer import Trainer

    recorded = res.get("config")
    if not isinstance(recorded, dict):
        return Verdict(res["cell"], False, ["the result records no config"])
    raw = dict(recorded)
    if isinstance(raw.get("qk"), dict):  # saved as {"options": {name: {...}}}, read as [qk.<name>]
        raw["qk"] = {k: v for k, v in raw["qk"].items() if k != "options"} | (raw["qk"].get("options") or {})
    cfg = from_dict(RunConfig, raw).validate()
    hashed = _hash_problem(res, cfg)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(out), name=res["cell"],
                                                             progress=False))
    data = prepare_data(cfg.data, log=log)
    stopped = None
    try:
        Trainer(cfg, resume=False, overwrite=True, data=data).run()
    except NonFiniteError as e:
        stopped = str(e)
    run_dir = out / res["cell"]
    new = build_result({}, run_dir, read_metrics(run_dir / "metrics.jsonl"),
                       unigram_entropy(data.select_tokens(), data.vocab_size), res.get("cell_hash"), 0.0, stopped)
    keys = [k for k in VERIFIED_KEYS if k in new or k in res]
    if res.get("probe") and not new.get("diverged"):  # the attention probes, as the study ran them
        from qklab.study.cell import _probe

        new["probe"] = _probe(run_dir, _probe_mult(res, cfg, results))
        keys.append("probe")
    added: list[str] = []
    diffs = hashed + _differences({k: new.get(k) for k in keys}, {k: res.get(k) for k in keys}, added)
    return Verdict(res["cell"], not diffs, diffs, machine_note(res.get("machines"), new.get("machines"), new, res)
                   if diffs else "", added)


def verify_results(results: Path, cells: int = 1, seed: int | None = None, out: Path | None = None,
                   log=print, warn=None, variants: list[str] | None = None,
                   same_machine: bool = False) -> list[Verdict]:
    """Retrain ``cells`` finished (ok or diverged) cells of a results folder, drawn at random (``seed``), each
    in a fresh run folder under ``out`` (default: a temporary folder, removed after). ``variants``: draw
    ``cells`` among each named variant's cells instead (a sample that covers each method's code).
    ``same_machine``: draw only among the cells trained on this kind of machine (float kernels differ between
    kinds, so only there is bit for bit expected)."""
    import random
    import shutil
    import tempfile

    results = Path(results)
    if type(cells) is not int or cells < 1:
        raise ConfigError(f"--cells {cells}: verify 1 or more cells")
    if not results.is_dir():
        what = "is a file, not a results folder" if results.exists() else "no such results folder"
        raise ConfigError(f"{results}: {what}; give a folder holding <cell>/result.json files")
    done = []
    for f in sorted(results.glob("*/result.json")):
        res, problem = load_result(f)
        if problem is not None and warn is not None:
            warn(f"warning: damaged result file {problem}; not verified")
        if res is not None and res.get("status") in DONE:
            done.append(res)
    if not done:
        raise ConfigError(f"{results} holds no finished (ok or diverged) result.json to verify")
    where = ""
    if same_machine:
        kept = [r for r in done if _trained_here(r)]
        unrecorded = sum(not r.get("machines") for r in done)
        m = _machine_here("cpu")
        kind = f"{m['cpu']}, {m['cpu_capability']}"
        if not kept:
            raise ConfigError(f"--same-machine: none of the {len(done)} finished cells in {results} was trained on "
                              f"this kind of machine ({kind})" + (f"; {unrecorded} record no machine (results "
                              "from before `machines` was recorded)" if unrecorded else ""))
        log(f"drawing among the {len(kept)} of {len(done)} finished cells trained on this kind of machine ({kind})")
        done, where = kept, " trained on this kind of machine"
    rng = random.Random(seed)
    if variants:
        have = sorted({str(r.get("variant")) for r in done})
        unknown = [v for v in variants if v not in have]
        if unknown:
            raise ConfigError(f"--variant {','.join(unknown)}: no finished cell of it{where} in {results} "
                              f"(variants with finished cells{where}: {', '.join(have)})")
        pools = [[r for r in done if r.get("variant") == v] for v in dict.fromkeys(variants)]
        chosen = [r for pool in pools for r in rng.sample(pool, min(cells, len(pool)))]
    else:
        chosen = rng.sample(done, min(cells, len(done)))
    from qklab.version import code_version

    here = code_version().record()
    tmp = Path(tempfile.mkdtemp(prefix="qklab-verify-")) if out is None else Path(out)
    try:
        verdicts = []
        for res in chosen:
            log(f"verify {res['cell']}: training it again from its result.json config")
            was = res.get("code") if isinstance(res.get("code"), dict) else {}
            if was.get("commit") and (was.get("commit"), was.get("diff_sha256")) != (here.get("commit"),
                                                                                   here.get("diff_sha256")):
                note = (f"  note: trained by code {was['commit'][:12]}{'-dirty' if was.get('dirty') else ''}, "
                        f"verified with {str(here.get('commit'))[:12]}{'-dirty' if here.get('dirty') else ''}")
                (warn or log)(note)
            v = verify_cell(res, tmp, log=lambda s: None, results=results)
            log(f"  {v.cell}: " + ("identical, bit for bit" if v.same else
                                   f"DIFFERS in {len(v.differences)} value(s): " + "; ".join(v.differences[:3])))
            if v.added:
                log(f"    not compared: {len(v.added)} value(s) this code measures that the committed result does "
                    f"not hold (measured since it was committed): {', '.join(v.added[:3])}"
                    + (", ..." if len(v.added) > 3 else ""))
            if v.note:
                log(f"    where: {v.note}")
            verdicts.append(v)
        return verdicts
    finally:
        if out is None:
            shutil.rmtree(tmp, ignore_errors=True)
