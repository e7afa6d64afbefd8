"""``ampguard lint``: a static checker for AMP mistakes in PyTorch training scripts.

The rules (:data:`RULES`, one per AG2xx code) read the source with the stdlib :mod:`ast` only;
this package never imports torch, so it runs in pre-commit in a fraction of a second.

>>> from ampguard.lint import lint_source
>>> src = "import torch\\nscaler = torch.cuda.amp.GradScaler()\\n"
>>> [f.code for f in lint_source(src)]
['AG206']
"""

from ampguard.lint._diff import unified_diff, unified_diff_bytes
from ampguard.lint._engine import DEFAULT_EXCLUDES, iter_python_files, parse_codes
from ampguard.lint._fix import FIXABLE, Fixed
from ampguard.lint._lint import fix_paths, fix_source, lint_paths, lint_source
from ampguard.lint._output import (
    FORMATS,
    SEVERITIES,
    failing,
    fixable,
    format_findings,
    summary_line,
)
from ampguard.lint._source import MAX_FILE_BYTES
from ampguard.lint.rules import RULES, Rule

__all__ = [
    "DEFAULT_EXCLUDES",
    "FIXABLE",
    "FORMATS",
    "Fixed",
    "MAX_FILE_BYTES",
    "RULES",
    "SEVERITIES",
    "Rule",
    "failing",
    "fix_paths",
    "fix_source",
    "fixable",
    "format_findings",
    "iter_python_files",
    "lint_paths",
    "lint_source",
    "parse_codes",
    "summary_line",
    "unified_diff",
    "unified_diff_bytes",
]
