"""The report names, per study, the code versions that trained its cells, and warns when there are several."""

from __future__ import annotations

from qklab.report.render import code_lines, code_version_of


def test_code_versions_per_study_and_the_warning():
    a = {"study": "a", "code": {"commit": "a" * 40, "dirty": False, "diff_sha256": None}}
    a_dirty = {"study": "a", "code": {"commit": "a" * 40, "dirty": True, "diff_sha256": "d" * 64}}
    old = {"study": "b", "git_sha": "b" * 40}  # a result from before ``code``: the HEAD at the cell's start
    assert code_version_of(a) == "a" * 12 and code_version_of(a_dirty) == "a" * 12 + "+diff " + "d" * 12
    assert code_version_of(old) == "b" * 12 + " (HEAD at the cell's start)"
    lines = [x for x in code_lines([a, a, a_dirty, old]) if x]
    assert lines[0].startswith(f"Code versions of `a` (cells): {'a' * 12} (2), {'a' * 12}+diff {'d' * 12} (1).")
    assert "Warning: 2 code versions" in lines[0]
    assert lines[1] == f"Code versions of `b` (cells): {'b' * 12} (HEAD at the cell's start) (1)."


def test_an_installed_package_says_unknown_once():
    """Cells trained from a wheel record no commit: one line says so, not a count per study."""
    cells = [{"study": s} for s in ("a", "a", "b")]
    assert [x for x in code_lines(cells) if x] == [
        "Code version: unknown (the cells recorded no commit: qklab ran from an installed package, not a git "
        "checkout)."]
    known = {"study": "a", "git_sha": "c" * 40}  # one cell that knows its commit: per study again
    assert len([x for x in code_lines([*cells, known]) if x]) == 2
