"""Project mode: what it follows (imports between files of the run, relative imports, re-exports)
and its bounds (files followed, file size, re-export hops, cycles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampguard.lint import lint_paths, lint_source
from ampguard.lint._project import MAX_FILE_BYTES, MAX_FOLLOWED, MAX_HOPS, Project

SAVER = "import torch\n\n\ndef save_checkpoint(state, path):\n    torch.save(state, path)\n"
TRAIN = (
    "import torch\n"
    "{imports}\n"
    "model = torch.nn.Linear(2, 2)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "scaler = torch.amp.GradScaler('cuda')\n"
    "state = {{'model': model.state_dict(), 'optimizer': opt.state_dict()}}\n"
    "{call}(state, 'ckpt.pt')\n"
)


def _codes(root: Path, **kwargs: object) -> list[tuple[str, int, str]]:
    return [
        (Path(f.path).name, f.line, f.code)
        for f in lint_paths([root], torch_version="2.13", **kwargs)
    ]


@pytest.mark.parametrize(
    ("imports", "call"),
    [
        ("from .utils import save_checkpoint", "save_checkpoint"),
        ("from . import utils", "utils.save_checkpoint"),
        ("from pkg.utils import save_checkpoint as save", "save"),
        ("import pkg.utils", "pkg.utils.save_checkpoint"),
    ],
)
def test_relative_and_package_imports_resolve(tmp_path: Path, imports: str, call: str) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "utils.py").write_text(SAVER)
    (pkg / "train.py").write_text(TRAIN.format(imports=imports, call=call))
    assert _codes(tmp_path) == [("train.py", 7, "AG205")]
    assert _codes(tmp_path, project=False) == []


def test_only_files_of_the_run_are_followed(tmp_path: Path) -> None:
    (tmp_path / "utils.py").write_text(SAVER)
    train = tmp_path / "train.py"
    train.write_text(
        TRAIN.format(imports="from utils import save_checkpoint", call="save_checkpoint")
    )
    assert _codes(train) == []  # utils.py is not part of this run
    assert _codes(tmp_path) == [("train.py", 7, "AG205")]


def test_a_file_over_the_size_cap_is_not_followed(tmp_path: Path) -> None:
    padding = "#" * 99 + "\n"
    (tmp_path / "utils.py").write_text(SAVER + padding * (MAX_FILE_BYTES // 100 + 1))
    (tmp_path / "train.py").write_text(
        TRAIN.format(imports="from utils import save_checkpoint", call="save_checkpoint")
    )
    assert _codes(tmp_path) == []


def test_files_followed_per_linted_file_are_capped(tmp_path: Path) -> None:
    paths = []
    for i in range(MAX_FOLLOWED + 8):
        path = tmp_path / f"m{i}.py"
        path.write_text("def f():\n    return 1\n")
        paths.append(str(path))
    project = Project(paths)
    parsed = [project.model(p) for p in paths]
    assert sum(m is not None for m in parsed) == MAX_FOLLOWED
    assert project.model(str(tmp_path / "elsewhere.py")) is None


def test_reexport_chains_stop_after_max_hops(tmp_path: Path) -> None:
    depth = MAX_HOPS + 3
    for i in range(depth):
        (tmp_path / f"m{i}.py").write_text(f"from m{i + 1} import save_checkpoint\n")
    (tmp_path / f"m{depth}.py").write_text(SAVER)
    near = tmp_path / f"m{depth - 1}.py"
    project = Project([str(p) for p in tmp_path.glob("*.py")])
    assert project.resolve("m0.save_checkpoint", str(tmp_path / "train.py")) is None
    found = project.resolve(f"m{depth - 1}.save_checkpoint", str(near))
    assert found is not None and found[1].name == "save_checkpoint"


def test_import_cycles_and_self_imports_terminate(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "from b import f\nfrom a import g\n\n\ndef g():\n    return f()\n"
    )
    (tmp_path / "b.py").write_text("from a import f\n")
    project = Project([str(p) for p in tmp_path.glob("*.py")])
    assert project.resolve("a.f", str(tmp_path / "x.py")) is None
    assert project.resolve("a.g", str(tmp_path / "x.py"))[1].name == "g"
    assert _codes(tmp_path) == []


def test_project_argument_is_checked() -> None:
    with pytest.raises(TypeError, match="project must be True or False"):
        lint_paths([], project="yes")  # type: ignore[arg-type]


def test_lint_source_lints_one_file_alone() -> None:
    src = TRAIN.format(imports="from utils import save_checkpoint", call="save_checkpoint")
    assert lint_source(src) == []
