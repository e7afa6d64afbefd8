"""The lint corpus holds fixtures written like training scripts (some named like tests): pytest
must not import them."""

collect_ignore_glob = ["*.py", "*/*.py", "*/*/*.py"]
