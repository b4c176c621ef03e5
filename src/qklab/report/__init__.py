"""Reports from result files alone: figures, tables, the claims table; Markdown, HTML and JSON."""

from qklab.report.render import ReportError, write_report

__all__ = ["ReportError", "write_report"]
