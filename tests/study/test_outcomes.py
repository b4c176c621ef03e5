"""A finished cell's outcome: ok, diverged (it blew up) or not learned (it ended above the unigram entropy
without blowing up), told apart wherever a user reads it, while the registered rule's ``diverged`` and the
statistics keep counting both; every committed result gets its outcome from the fields it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qklab.study.result import (
    BLOWUP_NATS,
    CellOutcome,
    build_result,
    cell_outcome,
    classify,
    failed_result,
    outcome_line,
    result_problem,
    tally,
)
from qklab.study.workers import Outcome, note_finished
from tests.study.synthetic import result

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
UNIGRAM = 6.0


def _built(tmp_path: Path, vals: list[float], losses: list[float] | None = None, events=(),
           stopped: str | None = None) -> dict:
    """build_result on hand-made metrics records: a train loss per step, then a selection loss per value."""
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "config.json").write_text(json.dumps({"model": {"attention": "mha"}, "train": {"lr": 1e-3},
                                                 "qk": {"method": "none", "controller": "none"}}))
    losses = [7.0, 6.5, 6.0] if losses is None else losses
    records = [{"step": i + 1, "loss": x} for i, x in enumerate(losses)]
    records += [{"step": 10 * (i + 1), "val_loss": v, "report_loss": v} for i, v in enumerate(vals)]
    records += [{"step": 5, "event": e} for e in events]
    return build_result({"schema": 1, "cell": "a_lr1_s0", "variant": "a", "lr_mult": 1.0, "seed": 0}, run,
                        records, UNIGRAM, "h", 1.0, stopped)


@pytest.mark.parametrize("vals, losses, events, stopped, want", [
    ([6.5, 5.5], None, (), None, CellOutcome.OK),  # below the unigram entropy at the end
    ([6.5, 5.9, 6.0], None, (), None, CellOutcome.OK),  # exactly at it: not above
    ([6.9, 6.8], None, (), None, CellOutcome.NOT_LEARNED),  # a short run at token frequencies
    ([5.25, 6.25], None, (), None, CellOutcome.NOT_LEARNED),  # rose, but by 1 nat: not more than it
    ([5.0, 6.0 + 1e-6], None, (), None, CellOutcome.DIVERGED),  # just more than 1 nat above its best
    ([4.0, 6.2], None, (), None, CellOutcome.DIVERGED),  # rose 2.2 nats above its best
    ([6.5, 5.5], [7.0, float("inf"), 6.0], (), None, CellOutcome.DIVERGED),  # a non-finite loss, learned or not
    ([6.5, 5.5], None, ("nonfinite_skip",), None, CellOutcome.DIVERGED),  # a non-finite step was skipped
    ([6.9], None, (), "non-finite loss at step 2", CellOutcome.DIVERGED),  # stopped on one
    ([float("nan")], None, (), None, CellOutcome.DIVERGED),  # a non-finite selection loss
])
def test_build_result_records_each_outcome_and_keeps_the_registered_status(tmp_path, vals, losses, events,
                                                                           stopped, want):
    res = _built(tmp_path, vals, losses, events, stopped)
    assert res["outcome"] == want and cell_outcome(res) is want
    assert res["diverged"] is (want is not CellOutcome.OK)  # the registered rule, as before
    assert res["status"] == ("ok" if want is CellOutcome.OK else "diverged")
    assert result_problem(json.loads(json.dumps(res, default=str))) is None
    del res["outcome"]  # a result written before the field: the same outcome from the fields it holds
    assert cell_outcome(json.loads(json.dumps(res, default=str))) is want


def test_classify_boundaries():
    nan = float("nan")
    assert classify("failed", False, False, nan, nan) is CellOutcome.FAILED
    assert classify("ok", False, True, nan, nan) is CellOutcome.OK  # the registered flag decides ok
    assert classify("diverged", True, False, 6.5, 6.5 - BLOWUP_NATS) is CellOutcome.NOT_LEARNED
    assert classify("diverged", True, False, 6.5, 6.4999 - BLOWUP_NATS) is CellOutcome.DIVERGED
    assert classify("diverged", True, False, 6.5, nan) is CellOutcome.NOT_LEARNED  # no best: the final one
    assert classify("diverged", True, False, 6.5, 7.0) is CellOutcome.NOT_LEARNED  # a best above the final
    assert classify("diverged", True, False, float("inf"), 5.0) is CellOutcome.DIVERGED
    assert classify("diverged", True, True, 6.5, 6.5) is CellOutcome.DIVERGED


def test_the_outcome_of_old_and_synthetic_results():
    """Without ``outcome``: the divergence reason, nonfinite_steps, best_val_loss or the selection curve
    tell a blow-up from a plateau; a recorded outcome is read where it agrees with the status, and one that
    contradicts it makes the file unusable."""
    assert cell_outcome(result("a", 1.0, 0, 5.0, 5.0)) is CellOutcome.OK
    assert cell_outcome(result("a", 1.0, 0, 5.0, 5.0, failed=True)) is CellOutcome.FAILED
    assert cell_outcome(result("a", 1.0, 0, 5.0, 5.0, diverged=True)) is CellOutcome.DIVERGED
    plateau = result("a", 1.0, 0, 6.5, 6.5, not_learned=True)
    assert cell_outcome(plateau) is CellOutcome.NOT_LEARNED
    for where in ({"best_val_loss": 4.0}, {"curves": {"val": {"step": [1, 2], "val_loss": [4.0, 6.5]}}}):
        assert cell_outcome({**plateau, **where}) is CellOutcome.DIVERGED, where
    assert cell_outcome({**plateau, "nonfinite_steps": 2}) is CellOutcome.DIVERGED
    assert cell_outcome({**plateau, "outcome": "diverged"}) is CellOutcome.DIVERGED  # as recorded
    assert cell_outcome({**plateau, "outcome": "ok"}) is CellOutcome.NOT_LEARNED  # disagrees: derived
    assert cell_outcome({**plateau, "outcome": "stalled"}) is CellOutcome.NOT_LEARNED  # unknown: derived
    assert result_problem({**plateau, "outcome": "ok"}) == "outcome 'ok' disagrees with status 'diverged'"
    assert result_problem({**plateau, "outcome": "not learned"}) is None
    assert failed_result({"cell": "a"}, "boom", None, 0.0)["outcome"] == "failed"


def _committed() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*/*/result.json"))]


@pytest.mark.skipif(not list(RESULTS.glob("*/*/result.json")), reason="no committed results")
def test_committed_results_outcomes():
    """Every committed result: schema 1, ok exactly when the registered rule says it did not diverge, and
    its outcome from the fields it holds. None blew up; those the rule counts as diverged are standard
    attention at x30-x100 on a plateau at token frequencies (not learned), as ``BLOWUP_NATS`` says."""
    res = _committed()
    assert {r.get("schema") for r in res} == {1}
    assert all(result_problem(r) is None for r in res)
    got = [cell_outcome(r) for r in res]
    assert all((o is CellOutcome.OK) == (r["status"] == "ok") == (not r["diverged"])
               for r, o in zip(res, got, strict=True))
    n_ok = got.count(CellOutcome.OK)
    assert tally(got) == f"{n_ok} ok, 0 diverged, {len(res) - n_ok} not learned, 0 failed"
    unlearned = sorted(f"{r['study']}/{r['cell']}" for r, o in zip(res, got, strict=True) if o is not CellOutcome.OK)
    assert {"logit_control_cpu/none_lr100_s0", "logit_control_cpu/none_lr100_s1",
            "logit_control_mla_cpu/mla-none_lr100_s0", "logit_control_mla_cpu/mla-none_lr100_s1",
            "logit_control_mla_cpu/mla-none_lr30_s0", "logit_control_mla_cpu/mla-none_lr30_s1"} <= set(unlearned)


class _Bar:
    disable = True

    def set_postfix_str(self, s, refresh=True):
        self.postfix = s


def test_each_finished_cell_and_the_tally_name_the_outcome():
    from qklab.study.spec import parse_study

    cells = parse_study({"study": {"config": "tiny", "seeds": [0, 1, 2, 3]}, "variants": {"a": {}}}, "t").cells
    res = [result("a", 1.0, 0, 5.0, 5.1), result("a", 1.0, 1, 5.0, 5.1, diverged=True),
           result("a", 1.0, 2, 6.5, 6.4, not_learned=True), result("a", 1.0, 3, 0, 0, failed=True)]
    lines, bar, outcome = [], _Bar(), Outcome()
    for cell, r in zip(cells, res, strict=True):
        note_finished(cell, {**r, "seconds": 3.0}, outcome, bar, {}, lines.append)
    assert lines[1].startswith("  a_lr1_s1: diverged (non-finite loss or gradient (planted))  val 5.0000")
    assert lines[2].startswith("  a_lr1_s2: not learned (final selection loss 6.5000 above the unigram entropy "
                               "6.0000)  val 6.5000  report 6.4000")
    assert lines[3].startswith("  a_lr1_s3: FAILED: KeyError: planted")
    assert outcome.tally() == "1 ok, 1 diverged, 1 not learned, 1 failed"
    assert bar.postfix == "done: 1 ok, 1 diverged, 1 not learned, 1 failed"
    assert outcome.counts() == {"ok": 1, "diverged": 2, "failed": 1}  # the registered statuses, as before
    rose = {**res[2], "curves": {"val": {"step": [1, 2], "val_loss": [4.5, 6.5]}}}
    assert outcome_line(rose) == ("diverged (final selection loss 6.5000 above the unigram entropy 6.0000; "
                                  "2.00 nats above its best 4.5000)")


def test_the_runner_says_which_cells_did_not_learn(tmp_path):
    """A tiny study, one cell trained long enough to learn and one stopped after 4 steps: the last line
    counts one ok and one not learned; the short cell stays diverged by the registered rule."""
    from qklab.study.runner import run_study
    from qklab.study.spec import parse_study

    common = {"train.steps": 40, "train.lr": 1e-2, "train.eval_every": 20, "train.ckpt_every": 20,
              "train.diag_every": 20, "data.max_files": 20, "data.cache_dir": str(tmp_path / "cache")}
    study = parse_study({"study": {"config": "tiny", "seeds": [0], "set": common},
                         "variants": {"std": {}, "short": {"train.steps": 4, "train.eval_every": 4,
                                                           "train.ckpt_every": 4, "train.diag_every": 4}},
                         "protocol": {"reference": "std"}}, "t")
    lines: list[str] = []
    o = run_study(study, tmp_path / "runs", tmp_path / "res", workers=0, log=lines.append)
    short = o.results["short_lr1_s0"]
    assert short["status"] == "diverged" and short["diverged"] and short["outcome"] == "not learned"
    assert any(ln.startswith("  short_lr1_s0: not learned (final selection loss") for ln in lines), lines
    assert lines[-1].startswith("study t: 1 ok, 0 diverged, 1 not learned, 0 failed (2 run now"), lines[-1]
