"""A symlink to a module that sorts before it does not take the module's name
away: the file is linted once, under its real name, and project mode still resolves imports of it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_lint_project import SAVER, TRAIN, _codes

pytestmark = pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")


def test_an_import_of_a_module_with_an_earlier_sorting_symlink_still_resolves(tmp_path: Path):
    (tmp_path / "utils.py").write_text(SAVER)
    os.symlink("utils.py", tmp_path / "a_alias.py")  # sorts before utils.py
    (tmp_path / "train.py").write_text(
        TRAIN.format(imports="from utils import save_checkpoint", call="save_checkpoint")
    )
    assert _codes(tmp_path) == [("train.py", 7, "AG205")]


def test_a_module_reached_through_a_symlink_is_linted_once_under_its_real_name(tmp_path: Path):
    (tmp_path / "train.py").write_text(
        TRAIN.format(imports="from utils import save_checkpoint", call="torch.save")
    )
    os.symlink("train.py", tmp_path / "a_train.py")
    assert _codes(tmp_path, project=False) == [("train.py", 7, "AG205")]


def test_a_symlink_alone_is_still_linted_under_its_own_name(tmp_path: Path):
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "train.py").write_text(
        TRAIN.format(imports="from utils import save_checkpoint", call="torch.save")
    )
    linted = tmp_path / "linted"
    linted.mkdir()
    os.symlink(real / "train.py", linted / "alias.py")
    assert _codes(linted, project=False) == [("alias.py", 7, "AG205")]
