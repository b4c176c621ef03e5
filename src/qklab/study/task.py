"""One Slurm array task: ``python -m qklab.study.task MANIFEST INDEX`` trains the cell at ``INDEX`` of a
submission's manifest, through the local worker's own path (``workers.worker_main``: the cell's log,
``cell.run_cell``, its checkpoint and ``result.json`` by rename).

A manifest (``<out>/slurm/<submission>.json``, written before ``sbatch``) holds what the study process
hands a local worker: the study's name, its folders, each cell's validated config and hash, the threads,
the probe setting and the code version. A cell is rebuilt from its recorded config and must hash as it
did when submitted; a task whose cell is already done (a requeue after its result) only says so.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from qklab.config import ConfigError, RunConfig, from_dict
from qklab.study.result import write_json_atomic
from qklab.study.spec import Cell, cell_hash

MANIFEST_SCHEMA = 1


@dataclasses.dataclass(frozen=True)
class Manifest:
    study: str
    out: Path
    results: Path
    threads: int
    probe: int
    code: dict[str, Any] | None
    cells: list[Cell]


def cell_record(cell: Cell) -> dict[str, Any]:
    return {"id": cell.id, "variant": cell.variant, "point": [list(kv) for kv in cell.point],
            "lr_mult": cell.lr_mult, "seed": cell.seed, "hash": cell.hash, "config": cell.cfg.to_dict()}


def cell_from_record(rec: dict[str, Any]) -> Cell:
    """The cell a manifest records, its config parsed and validated again; refused when it no longer
    hashes as it did (a qklab of other defaults on the nodes than on the submitting host)."""
    raw = dict(rec["config"])
    if isinstance(raw.get("qk"), dict):  # saved as {"options": {name: {...}}}, read as [qk.<name>]
        raw["qk"] = {k: v for k, v in raw["qk"].items() if k != "options"} | (raw["qk"].get("options") or {})
    cfg = from_dict(RunConfig, raw).validate()
    if cell_hash(cfg) != rec["hash"]:
        raise ConfigError(f"cell {rec['id']}: its config hashes to {cell_hash(cfg)} here, {rec['hash']} where it was "
                          "submitted; run the nodes and the submitting host on the same qklab")
    point = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rec["point"])
    return Cell(rec["id"], rec["variant"], point, rec["lr_mult"], rec["seed"], cfg, rec["hash"])


def write_manifest(path: Path, m: Manifest) -> None:
    write_json_atomic(path, {"schema": MANIFEST_SCHEMA, "study": m.study, "out": str(m.out),
                             "results": str(m.results), "threads": m.threads, "probe": m.probe, "code": m.code,
                             "cells": [cell_record(c) for c in m.cells]})


def read_manifest(path: Path, index: int | None = None) -> Manifest:
    """The manifest at ``path``; with ``index``, only that cell is rebuilt."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != MANIFEST_SCHEMA:
        raise ConfigError(f"{path}: a manifest of schema {data.get('schema')}, this qklab reads {MANIFEST_SCHEMA}")
    recs = data["cells"] if index is None else [data["cells"][index]]
    return Manifest(data["study"], Path(data["out"]), Path(data["results"]), data["threads"], data["probe"],
                    data["code"], [cell_from_record(r) for r in recs])


def cell_ids(path: Path) -> list[str]:
    """The cell ids of a manifest, by array index (without rebuilding their configs)."""
    return [c["id"] for c in json.loads(Path(path).read_text())["cells"]]


def main(argv: list[str]) -> int:
    from qklab.study.runner import cell_status
    from qklab.study.workers import worker_main

    manifest, index = Path(argv[0]), int(argv[1])
    m = read_manifest(manifest, index)
    cell = m.cells[0]
    if cell_status(cell, m.results)[0] == "done":
        print(f"qklab: cell {cell.id} is done already ({m.results / cell.id / 'result.json'}); nothing to train")
        return 0
    print(f"qklab: cell {cell.id} of study {m.study}; its log: {m.out / 'logs' / f'{cell.id}.log'}", flush=True)
    worker_main(cell, m.study, m.out, m.results, m.threads, m.probe, None, m.code)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        print(f"qklab: error: {e}", file=sys.stderr)
        sys.exit(2)
