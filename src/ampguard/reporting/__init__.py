"""``ampguard.reporting``: the offline HTML report and the terminal summary of a run folder.

>>> path = ampguard.report("runs/exp1")      # writes runs/exp1/report.html and findings.json
>>> print(ampguard.reporting.summary("runs/exp1"))
ampguard report: runs/exp1 ...
"""

from ampguard.reporting._report import print_summary, report, summary

__all__ = ["report", "summary", "print_summary"]
