"""The run report: one static HTML page plus PNG figures, built from the files the jobs wrote."""

from relicv2.evaluation.report.html import ReportInputs, ReportSummary, build_report

__all__ = ["ReportInputs", "ReportSummary", "build_report"]
