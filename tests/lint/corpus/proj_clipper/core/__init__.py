# ruff: noqa  (a fixture written in the style of third-party training scripts)
from .hooks import GradClipper
