"""``qklab report DIR --beside DIR``: the claims of two sets of results side by side, each read on its own
(its own registered plan, its own Holm family), checked against the sign-flip and Holm values worked out by
hand for planted results."""

from __future__ import annotations

import json

import pytest

from qklab.cli.commands import main
from qklab.report import write_report
from qklab.study.catalogue import CATALOGUE
from qklab.study.result import write_json_atomic
from tests.study.synthetic import result


def _study(root, name: str, source: str, seeds: int, claims: list[str], effect: float = -0.1):
    """none, qknorm and qkmap at one rate on ``source``; qkmap lower by ``effect`` (plus noise) at every seed."""
    res = root / name
    write_json_atomic(res / "study.json", {"name": name, "config": "tiny", "seeds": list(range(seeds)),
                                           "variants": {v: {} for v in ("none", "qknorm", "qkmap")},
                                           "plan": {"claims": {c: CATALOGUE[c].params() for c in claims}},
                                           "protocol": {"reference": "none", "lr_mults": [1.0]}})
    for s in range(seeds):
        n = 0.01 * ((s * 7) % 5 - 2)  # -0.02 .. +0.02
        for v, loss, ft in (("none", 5.0, 0.2), ("qknorm", 5.0 + n / 2, 0.2), ("qkmap", 5.0 + effect + n, 0.1)):
            c = result(v, 1.0, s, loss, loss, method=v, first_token=ft, study=name)
            c["config"]["data"] = {"source": source}
            write_json_atomic(res / c["cell"] / "result.json", c)
    return res


@pytest.fixture
def pair(tmp_path):
    en = _study(tmp_path, "en", "english", 8, ["qkmap.val_vs_none", "qkmap.val_vs_qknorm", "qkmap.first_token"])
    code = _study(tmp_path, "code", "pystdlib", 5, ["qkmap.val_vs_none", "qkmap.train_vs_none", "qkmap.val_vs_quest"])
    return en, code


def test_each_set_keeps_its_own_plan_and_family(tmp_path, pair):
    en, code = pair
    out = write_report([en], out=tmp_path / "rep", beside=[code])
    data = json.loads((out / "report.json").read_text())
    head, rows = data["tables"]["beside"]["head"], data["tables"]["beside"]["rows"]
    assert head[2] == "verdict, natural English" and head[5] == "verdict, Python source"
    got = {r[1]: dict(zip(head, r, strict=True)) for r in rows}
    # registered on either side, in catalogue order; the claims neither registered are left out
    assert list(got) == ["lower validation loss than Standard attention", "lower validation loss than QK-Norm",
                         "lower training loss than Standard attention",
                         "less attention on the first token than Standard attention",
                         "lower validation loss than QUEST (keys on the sphere, queries free)"]
    r = got["lower validation loss than Standard attention"]
    # English: 8 seeds, all one way: sign-flip p = 2/2^8; Holm over its 3 registered claims, all at that p
    assert r["verdict, natural English"] == "**agree**"
    assert r["n and test, natural English"] == f"n=8, sign-flip p {2 / 256:.3g}, Holm p {3 * 2 / 256:.3g}"
    assert r["measured, natural English"].startswith("qkmap - none: -0.100")
    # code: 5 seeds: p = 2/2^5, Holm over its own 2 registered claims; underpowered; the old rule agrees
    assert r["verdict, Python source"] == "**underpowered**"
    assert r["n and test, Python source"] == f"n=5, sign-flip p {2 / 32:.3g}, Holm p {2 * 2 / 32:.3g}"
    assert r["old rule, Python source"] == "agree"
    # registered on one side only: the other reads it as exploratory (no family, no Holm p)
    q = got["lower validation loss than QK-Norm"]
    assert q["verdict, Python source"] == "exploratory" and "Holm" not in q["n and test, Python source"]
    assert got["lower training loss than Standard attention"]["verdict, natural English"] == "exploratory"
    # registered where no cell can measure it (no QUEST variant on either side): not measurable there, not run here
    quest = got["lower validation loss than QUEST (keys on the sphere, queries free)"]
    assert quest["verdict, Python source"] == "**not measurable**" and quest["measured, Python source"] == "-"
    assert quest["verdict, natural English"] == "not run" and quest["n and test, natural English"] == "-"
    md = (out / "report.md").read_text()
    assert "## Beside: the same claims on Python source (`pystdlib`)" in md
    assert "on natural English (`english`)" in md
    assert data["beside"]["sources"] == [str(code)] and len(data["beside"]["cells"]) == 15


def test_the_same_corpus_twice_reads_here_and_beside(tmp_path, pair):
    en, _ = pair
    other = _study(tmp_path, "en2", "english", 6, ["qkmap.val_vs_none"])
    out = write_report([en], out=tmp_path / "rep", beside=[other])
    head = json.loads((out / "report.json").read_text())["tables"]["beside"]["head"]
    assert head[2] == "verdict, here" and head[5] == "verdict, beside"


def test_cli_beside_and_a_missing_folder(tmp_path, pair, capsys):
    en, code = pair
    assert main(["report", str(en), "--beside", str(code), "--out", str(tmp_path / "cli")]) == 0
    assert "beside" in json.loads((tmp_path / "cli" / "report.json").read_text())["tables"]
    capsys.readouterr()
    assert main(["report", str(en), "--beside", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()  # refused before anything is written
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nowhere: no such folder" in err[0]
