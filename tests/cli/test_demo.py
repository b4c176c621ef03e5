"""``qklab demo`` cut short: cells that have not learned beyond token frequencies are named so, not
diverged, with their losses in the table (real numbers, not nan), and the demo exits 0."""

from __future__ import annotations

import math

from qklab.cli import main


def test_a_short_demo_names_its_cells_not_learned_and_shows_their_losses(tmp_path, capsys):
    short = ["train.steps=4", "train.eval_every=4", "train.ckpt_every=4", "train.diag_every=4", "train.log_every=2",
             "train.warmup_steps=2", "data.tokenizer=bytes", "data.max_files=20", f"data.cache_dir={tmp_path / 'c'}"]
    argv = ["demo", "--methods", "none", "--workers", "0", "--out", str(tmp_path / "d")]
    assert main([*argv, *(a for s in short for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "study demo: 0 ok, 0 diverged, 2 not learned, 0 failed" in out
    assert "none_lr1_s0: not learned (final selection loss" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("none "))
    cols = row.split()
    assert cols[1:3] == ["mha", "2"] and row.endswith("2 not learned"), row
    assert math.isfinite(float(cols[3])) and float(cols[5]) > 0, row  # report loss ± std, max logit: numbers
    assert "nan" not in row
    assert "not learned: 2 cell(s) ended with a selection loss above the unigram entropy" in out
    md = (tmp_path / "d" / "report" / "report.md").read_text()
    assert "| none | mha | not learned (2/2) |" in md  # the sensitivity table
