"""Studies: grids of training runs (cells) with a fair protocol, results as committed data."""

from qklab.study.analyze import analyze, load_results, select_rate
from qklab.study.runner import run_study
from qklab.study.spec import Study, load_study, parse_study

__all__ = ["Study", "analyze", "load_results", "load_study", "parse_study", "run_study", "select_rate"]
