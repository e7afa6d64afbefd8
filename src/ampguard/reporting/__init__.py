"""``ampguard.reporting``: the offline HTML report and the terminal summary of a run folder.

>>> path = ampguard.report("runs/exp1")      # writes runs/exp1/report.html and findings.json
>>> print(ampguard.reporting.summary("runs/exp1"))
ampguard report: runs/exp1 ...
"""

from ampguard.reporting._fp8 import text_lines as fp8_text_lines
from ampguard.reporting._on_close import write_report
from ampguard.reporting._report import (
    Analysis,
    analyse,
    need_matplotlib,
    print_summary,
    report,
    summary,
)

__all__ = [
    "report",
    "summary",
    "print_summary",
    "Analysis",
    "analyse",
    "need_matplotlib",
    "fp8_text_lines",
    "write_report",
]
