"""Project mode at speed: over a detection repository's tree, project mode parses
each file once, costs at most 3x linting each file alone, and its shortcuts change no finding."""

from __future__ import annotations

import gc
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ampguard.lint._engine as engine
import ampguard.lint._events as events
import ampguard.lint._project as project
from ampguard.lint import iter_python_files, lint_paths, lint_source
from ampguard.lint._engine import lint_bytes, make_options, relaxed_gc
from ampguard.lint._project import Project

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
CORPUS = Path(__file__).resolve().parent / "corpus"


def _yolo_tree(root: Path) -> Path:
    spec = importlib.util.spec_from_file_location("yolo_tree", BENCH / "yolo_tree.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_tree(str(root))
    return root


@pytest.fixture(scope="module")
def yolo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _yolo_tree(tmp_path_factory.mktemp("yolo"))


def _keys(findings: list) -> list[tuple]:
    return [(f.path, f.line, f.col, f.code, f.message) for f in findings]


@pytest.mark.slow  # lints a 16,000-line tree
def test_the_tree_is_detection_repository_shaped(yolo: Path) -> None:
    files = list(iter_python_files([yolo]))
    lines = sum(Path(f).read_text().count("\n") for f in files)
    assert 15_000 <= lines <= 17_000
    names = {Path(f).relative_to(yolo).as_posix() for f in files}
    assert {"train.py", "val.py", "models/yolo.py", "utils/general.py"} <= names
    codes = {f.code for f in lint_paths([yolo])}
    assert {"AG205", "AG206", "AG208"} <= codes  # what a real YOLO-style repository gets


@pytest.mark.slow  # lints a 16,000-line tree twice
def test_inert_helper_shortcut_changes_no_finding(
    yolo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every helper interpreted in full (the shortcut off) gives the very same findings."""
    roots = [yolo, CORPUS]
    fast = _keys(lint_paths(roots))
    monkeypatch.setattr(events, "summary", lambda *args, **kwargs: None)
    assert _keys(lint_paths(roots)) == fast


PLAIN_HELPER = (
    "import torch\n"
    "def log(msg, step):\n"
    "    step = int(step)\n"
    "    if step % 10 == 0:\n"
    "        print(msg)\n"
    "def train(model, opt, loader):\n"
    "    scaler = torch.amp.GradScaler('cuda')\n"
    "    for i, x in enumerate(loader):\n"
    "        scaler.scale(model(x)).backward()\n"
    "        log('step', i)\n"
    "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    "        scaler.step(opt)\n"
    "        scaler.update()\n"
)


def test_an_inert_helper_does_not_hide_a_finding() -> None:
    assert [(f.line, f.code) for f in lint_source(PLAIN_HELPER)] == [(11, "AG201")]


HELPERS = """
import torch
from pathlib import Path

def pure(x, y):
    z = x + y
    if y:
        z = z * 2
    return z

def rebinds(path, n):
    path = Path(path)
    for n in range(3):
        pass
    return path

def mutates(cfg):
    cfg.amp = False

def forwards(cfg, other):
    mutates(cfg)
    mutates(other.inner)
    rebinds(cfg, 1)

def raises(scaler):
    if scaler is None:
        raise ValueError("no scaler")

def forever(q):
    while True:
        q.get()

def steps(scaler, opt):
    scaler.step(opt)

def calls_steps(scaler, opt):
    steps(scaler, opt)

def uses_global():
    global STATE
    STATE = 1

def ping(n):
    return pong(n - 1)

def pong(n):
    return ping(n)

def nested_raise(x):
    def inner():
        raise ValueError
    return x
"""


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("pure", frozenset()),
        ("rebinds", frozenset({"path", "n"})),
        ("mutates", frozenset({"cfg"})),
        ("forwards", frozenset({"cfg", "other"})),
        ("raises", None),
        ("forever", None),
        ("steps", None),
        ("calls_steps", None),
        ("uses_global", None),
        ("ping", None),  # a call cycle is judged conservatively
        ("nested_raise", frozenset()),  # a nested def's body does not run
    ],
)
def test_helper_summaries(name: str, expected: frozenset[str] | None) -> None:
    import ast

    from ampguard.lint._events import Events, header
    from ampguard.lint._inert import summary
    from ampguard.lint._model import FileModel

    model = FileModel(ast.parse(HELPERS))
    extractor = Events(model)
    extractor.scalers = frozenset({"scaler"})  # a helper's parameter, as a caller passes it
    [func] = model.functions[name]
    assert summary(extractor, func, header) == expected


def test_project_mode_parses_each_file_once(yolo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    real = project.parse

    def counting(source: str | bytes, path: str):  # type: ignore[no-untyped-def]
        parsed.append(str(Path(path).resolve()))
        return real(source, path)

    monkeypatch.setattr(project, "parse", counting)
    monkeypatch.setattr(engine, "parse", counting)
    lint_paths([yolo])
    assert parsed, "nothing was parsed"
    assert len(parsed) == len(set(parsed)), sorted(p for p in parsed if parsed.count(p) > 1)


def test_a_changed_file_is_parsed_again(tmp_path: Path) -> None:
    """The reuse is keyed by the bytes: an edited file is never linted from a stale model."""
    (tmp_path / "utils.py").write_text("import torch\n\ndef load(p):\n    return torch.load(p)\n")
    files = [str(tmp_path / "utils.py")]
    tree = Project(files)
    options = make_options(torch_version="2.4")
    assert tree.model(files[0]) is not None  # followed first, as an importer would
    edited = b"import torch\n\n\ndef load(p):\n    return torch.load(p, weights_only=False)\n"
    [finding] = lint_bytes(edited, files[0], options, tree)
    assert finding.line == 5 and "weights_only=False" in finding.message


@pytest.mark.slow  # times lint over a 16,000-line tree
def test_project_mode_costs_at_most_3x_single_file(yolo: Path) -> None:
    files = [(p, Path(p).read_bytes()) for p in iter_python_files([yolo])]
    options = make_options()

    def cpu(use_project: bool) -> float:
        tree = Project([p for p, _ in files]) if use_project else None
        start = time.process_time()
        with relaxed_gc():
            for path, data in files:
                lint_bytes(data, path, options, tree)
        return time.process_time() - start

    single = min(cpu(False) for _ in range(2))
    whole = min(cpu(True) for _ in range(2))
    assert whole <= 3 * single, (whole, single)


def test_relaxed_gc_restores_the_thresholds() -> None:
    before = gc.get_threshold()
    with relaxed_gc():
        assert gc.get_threshold()[0] >= 50_000
    assert gc.get_threshold() == before
    with pytest.raises(KeyError), relaxed_gc():
        raise KeyError("x")
    assert gc.get_threshold() == before


@pytest.mark.slow  # runs the lint benchmark in a subprocess
def test_bench_reports_project_mode_on_the_tree() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_lint.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    ).stdout
    import json

    result = json.loads(out)
    assert result["root"] == "yolo-style detection tree"
    assert result["files"] >= 20 and result["lines"] >= 15_000
    assert {"lint_lines_per_s", "single_file_lines_per_s", "project_over_single"} <= set(result)


@pytest.mark.slow  # runs the lint benchmark in a subprocess
def test_bench_reports_one_row_per_tree_and_gates_on_the_goal() -> None:
    trees = [str(CORPUS / "proj_factory"), str(CORPUS / "proj_saver")]

    def bench(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(BENCH / "bench_lint.py"), *trees, *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )

    import json

    rows = json.loads(bench("--json", "--goal", "0").stdout)
    assert [r["root"] for r in rows] == trees
    assert all(r["lint_lines_per_s"] > 0 and r["files"] >= 2 for r in rows)
    slow = bench("--goal", "1000000000")
    assert slow.returncode == 1 and "under 1000000000 lines/s" in slow.stdout
    assert bench("/no/such/tree").returncode == 2


def test_a_judgement_is_kept_after_the_follow_budget_ran_out(tmp_path: Path) -> None:
    """Once a linted file has followed MAX_FOLLOWED files, a helper judged without needing a
    refused file is cached all the same (a detection repository reached the cap on its first
    files, and then judged the same helpers thousands of times); one that needed a refused file
    is not."""
    import ast

    from ampguard.lint._events import Events, header
    from ampguard.lint._inert import summary

    (tmp_path / "helpers.py").write_text(
        "from far import remote\n\ndef pure(x):\n    return x + 1\n\n"
        "def calls_far(x):\n    return remote(x)\n"
    )
    (tmp_path / "far.py").write_text("def remote(x):\n    return x\n")
    files = [str(tmp_path / "helpers.py"), str(tmp_path / "far.py")]
    tree = Project(files)
    model = tree.model(files[0])
    assert model is not None
    tree._budget = 0  # this linted file has followed all it may
    extractor = Events(model)
    pure = next(f for f in model.tree.body if isinstance(f, ast.FunctionDef) and f.name == "pure")
    far = next(
        f for f in model.tree.body if isinstance(f, ast.FunctionDef) and f.name == "calls_far"
    )
    assert summary(extractor, pure, header) == frozenset()
    assert getattr(pure, "_ag_inert", None) == frozenset()  # cached although exhausted
    summary(extractor, far, header)
    assert tree.denied > 0  # far.py was refused ...
    assert getattr(far, "_ag_inert", None) is None  # ... so that answer is not kept


_CALLERS = """
import torch
scaler = torch.amp.GradScaler("cuda")

def train(model, opt, loader):
    for x in loader:
        if x is None:
            raise ValueError(x)
        scaler.scale(model(x)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
"""


@pytest.mark.parametrize("callers", [1, 6])
def test_a_helper_is_interpreted_once_however_many_units_call_it(
    callers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flow rules memoise an inlined helper's exit per entry state: six callers of
    ``train()`` cost what one does (it was inlined again into each), with the same findings."""
    import ampguard.lint._flow as flow

    source = _CALLERS + "".join(
        f"\ndef main{i}(model, opt, loader):\n    train(model, opt, loader)\n"
        for i in range(callers)
    )
    visits = {"n": 0}
    real = flow.Interpreter._block

    def counting(self, stmts, state, env):  # type: ignore[no-untyped-def]
        if env.active and stmts is env.active[-1].body:
            visits["n"] += 1
        return real(self, stmts, state, env)

    monkeypatch.setattr(flow.Interpreter, "_block", counting)
    found = lint_source(source, "train.py")
    assert [(f.line, f.code) for f in found if f.code == "AG201"] == [(10, "AG201")]
    # one interpretation per analysis and recording mode, whatever the number of callers
    assert visits["n"] <= 4, visits
