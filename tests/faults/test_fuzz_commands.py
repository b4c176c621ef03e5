"""Fuzzed study files, results folders and report/probe/export/study arguments: each is a valid study
(or run) or one line with exit 2, never a traceback. Nothing here trains: studies are parsed and their
status listed, reports read result files, probe and export fail before loading a model or read the
session's reference run."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.faults.common import LEDGER, cli

FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SCALARS = st.one_of(st.integers(-3, 5), st.sampled_from([1e400, 0.5, -1.0]), st.booleans(),
                    st.sampled_from(["tiny", "", "x y", "none", "train.lr", "qknorm", "nope", "a"]))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.sampled_from(["a", "mha"]), SCALARS,
                                                                           max_size=2))
STUDY_KEYS = ["name", "config", "seeds", "set", "workers", "bogus"]
PROTO_KEYS = ["reference", "lr_mults", "lr_mults_for", "lr_key", "data_seed", "probe", "reuse"]


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "1e400" if v == 1e400 else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(_toml, v)) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items()) + "}"


STUDIES = st.tuples(st.dictionaries(st.sampled_from(STUDY_KEYS), VALUES, max_size=3),
                    st.dictionaries(st.sampled_from(PROTO_KEYS), VALUES, max_size=3),
                    st.lists(st.sampled_from(["a", "b", "none"]), max_size=2, unique=True),
                    st.binary(max_size=3))


@settings(FUZZ, max_examples=150)
@given(STUDIES)
def test_fuzzed_study_files_parse_or_fail_with_one_line(faults_root, case):
    study, proto, variants, junk = case
    LEDGER.fuzzed += 1
    text = ("[study]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in study.items())
            + "".join(f'[variants.{v}]\n"train.steps" = 1\n' for v in variants)
            + "[protocol]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in proto.items()))
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "s.toml"
        f.write_bytes(text.encode() + (b"#" + junk if junk else b""))
        r = cli("study", "status", str(f), "--out", f"{d}/o", "--results", f"{d}/r")
    assert "Traceback" not in r.err, r.err
    assert r.code in (0, 2), r.err
    if r.code == 2:
        assert len(r.err_lines) == 1 and r.err_lines[0].startswith("qklab: error:"), r.err


FILES = st.sampled_from([b"", b"[]", b"{}", b'"x"', b"\xff", b"null", b"{\"cell\": 1}", b'{"name": []}',
                         b'{"cell": "a_lr1_s0", "variant": "a", "lr_mult": 1, "seed": 0, "status": "failed"}',
                         b'{"name": "s", "protocol": [], "variants": {}}'])
FOLDERS = st.lists(st.tuples(st.sampled_from(["a_lr1_s0/result.json", "b/result.json", "study.json",
                                              "notes/result.json", "x/y/result.json"]), FILES), max_size=4)


@settings(FUZZ, max_examples=60)
@given(FOLDERS, st.lists(st.sampled_from(["--out", "--title", "x", "", "-", "--bogus", "."]), max_size=3))
def test_fuzzed_results_folders_and_report_arguments(faults_root, files, extra):
    LEDGER.fuzzed += 1
    # in the temp folder, so that "." and "x" name its folders, not the checkout (whose 1,300 committed cells
    # took 35 s to report on each time: three minutes of the suite)
    with tempfile.TemporaryDirectory() as d, contextlib.chdir(d):
        res = Path(d) / "res"
        res.mkdir()
        for rel, data in files:
            (res / rel).parent.mkdir(parents=True, exist_ok=True)
            (res / rel).write_bytes(data)
        r = cli("report", str(res), *extra, *(["--out", f"{d}/rep"] if "--out" not in extra else []))
    assert "Traceback" not in r.err, r.err
    assert r.code in (0, 2), r.err
    if r.code == 2:
        assert len(r.err_lines) == 1 and r.err_lines[0].startswith("qklab: error:"), r.err


TOKENS = ["--batch", "--samples", "--max-mult", "--seg-len", "--device", "--out", "--compare", "--no-evidence",
          "--allow-unverified", "0", "-1", "3", "8", "99999", "cuda:x", "auto", "RUN", "RUN/ckpt", "nope", "",
          "RUN/ckpt/step_0000030", "RUN/ckpt/step_9999999"]


@settings(FUZZ, max_examples=40)
@given(st.sampled_from(["probe", "export"]), st.lists(st.sampled_from(TOKENS), max_size=5))
def test_fuzzed_probe_and_export_arguments(reference, command, argv):
    LEDGER.fuzzed += 1
    argv = [a.replace("RUN", str(reference)) for a in argv]
    if command == "export" and not any(a.startswith(str(reference)) for a in argv):
        argv = ["nope", *argv]
    with tempfile.TemporaryDirectory() as d:
        out = ["--out", d] if "--out" not in argv else []
        fast = ["--no-evidence", "--batch", "1"] if command == "probe" else []
        r = cli(command, *argv, *out, *(fast if command == "probe" and "--batch" not in argv else []))
    assert "Traceback" not in r.err, r.err
    assert r.code in (0, 2), r.err
    if r.code == 2:
        assert len(r.err_lines) == 1 and r.err_lines[0].startswith("qklab: error:"), r.err
