"""``ampguard lint --fix`` / ``--diff``: every fixable rule by round trip (fix,
re-lint, no finding of that rule, the rest of the file byte-identical), idempotence, what is left
alone, and ``--diff`` writing nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _lint import lint_cli

from ampguard.lint import FIXABLE, fix_paths, fix_source, lint_paths, lint_source, unified_diff

# (code, source, expected fixed source, torch version); the expected text is the original with
# only the fix's edit, so equality proves the rest of the file byte for byte.
CASES = {
    "ag206_call": (
        "AG206",
        "import torch  # keep me\n\n"
        "scaler = torch.cuda.amp.GradScaler(enabled=use_amp)   # odd  spacing\n",
        "import torch  # keep me\n\n"
        'scaler = torch.amp.GradScaler("cuda", enabled=use_amp)   # odd  spacing\n',
        None,
    ),
    "ag206_autocast_positional": (
        "AG206",
        "import torch\nwith torch.cuda.amp.autocast(amp, torch.float16):\n    y = net(x)\n",
        'import torch\nwith torch.amp.autocast("cuda", enabled=amp, dtype=torch.float16):\n'
        "    y = net(x)\n",
        None,
    ),
    "ag206_cpu_single_quotes": (
        "AG206",
        "import torch\nname = 'x'\nwith torch.cpu.amp.autocast(dtype=torch.bfloat16):\n    pass\n",
        "import torch\nname = 'x'\nwith torch.amp.autocast('cpu', dtype=torch.bfloat16):\n"
        "    pass\n",
        None,
    ),
    "ag206_from_import": (
        "AG206",
        "from torch.cuda.amp import GradScaler, autocast\n\n"
        "scaler = GradScaler(\n    init_scale=2.0**16,\n)\nwith autocast():\n    loss = f()\n",
        "from torch.amp import GradScaler, autocast\n\n"
        'scaler = GradScaler(\n    "cuda", init_scale=2.0**16,\n)\nwith autocast("cuda"):\n'
        "    loss = f()\n",
        None,
    ),
    "ag206_module_import": (
        "AG206",
        "from torch.cuda import amp\nscaler = amp.GradScaler()\n",
        'from torch import amp\nscaler = amp.GradScaler("cuda")\n',
        None,
    ),
    "ag206_decorators": (
        "AG206",
        "import torch\n\n@torch.cuda.amp.custom_fwd\ndef f(ctx, x):\n    return x\n\n"
        "@torch.cuda.amp.custom_bwd\ndef g(ctx, x):\n    return x\n",
        'import torch\n\n@torch.amp.custom_fwd(device_type="cuda")\ndef f(ctx, x):\n'
        '    return x\n\n@torch.amp.custom_bwd(device_type="cuda")\ndef g(ctx, x):\n    return x\n',
        None,
    ),
    "ag201": (
        "AG201",
        "import torch\n\nscaler = torch.amp.GradScaler('cuda')\nfor x in loader:\n"
        "    scaler.scale(model(x)).backward()\n"
        "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clip here\n"
        "    scaler.step(opt)\n    scaler.update()\n",
        "import torch\n\nscaler = torch.amp.GradScaler('cuda')\nfor x in loader:\n"
        "    scaler.scale(model(x)).backward()\n    scaler.unscale_(opt)\n"
        "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clip here\n"
        "    scaler.step(opt)\n    scaler.update()\n",
        None,
    ),
    "ag201_self": (
        "AG201",
        "import torch\nclass Trainer:\n    def __init__(self):\n"
        "        self.scaler = torch.amp.GradScaler('cuda')\n"
        "    def step(self, loss):\n        self.scaler.scale(loss).backward()\n"
        "        torch.nn.utils.clip_grad_norm_(\n"
        "            self.model.parameters(), 1.0\n        )\n"
        "        self.scaler.step(self.optimizer)\n        self.scaler.update()\n",
        "import torch\nclass Trainer:\n    def __init__(self):\n"
        "        self.scaler = torch.amp.GradScaler('cuda')\n"
        "    def step(self, loss):\n        self.scaler.scale(loss).backward()\n"
        "        self.scaler.unscale_(self.optimizer)\n"
        "        torch.nn.utils.clip_grad_norm_(\n"
        "            self.model.parameters(), 1.0\n        )\n"
        "        self.scaler.step(self.optimizer)\n        self.scaler.update()\n",
        None,
    ),
    "ag204": (
        "AG204",
        "import torch\nscaler = torch.amp.GradScaler('cuda')\nfor x in loader:\n"
        "    scaler.scale(model(x)).backward()\n    scaler.step(opt)  # no update\n"
        "    opt.zero_grad()\n",
        "import torch\nscaler = torch.amp.GradScaler('cuda')\nfor x in loader:\n"
        "    scaler.scale(model(x)).backward()\n    scaler.step(opt)  # no update\n"
        "    scaler.update()\n    opt.zero_grad()\n",
        None,
    ),
    "ag208": (
        "AG208",
        "import torch\nmodel.load_state_dict(torch.load('m.pt', map_location='cpu'))\n"
        "sd = torch.load(\n    'x.pt',\n)\nnet.load_state_dict(sd['model'])\n"
        "opt.load_state_dict(sd['optimizer'])\n",
        "import torch\n"
        "model.load_state_dict(torch.load('m.pt', map_location='cpu', weights_only=True))\n"
        "sd = torch.load(\n    'x.pt', weights_only=True,\n)\nnet.load_state_dict(sd['model'])\n"
        "opt.load_state_dict(sd['optimizer'])\n",
        "2.4",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip(name: str) -> None:
    code, source, expected, version = CASES[name]
    assert code in {f.code for f in lint_source(source, torch_version=version)}
    result = fix_source(source, torch_version=version)
    assert result.text == expected
    assert result.changed and {f.code for f in result.fixed} == {code}
    assert code not in {f.code for f in lint_source(result.text, torch_version=version)}
    again = fix_source(result.text, torch_version=version)  # idempotent
    assert (again.text, again.fixed, again.changed) == (result.text, [], False)


def test_every_fixable_rule_has_a_round_trip() -> None:
    assert {case[0] for case in CASES.values()} == FIXABLE


def test_crlf_and_non_ascii_are_kept() -> None:
    source = "import torch\r\nname = 'é'  # naïve\r\nx = 'é'; s = torch.cuda.amp.GradScaler()\r\n"
    fixed = fix_source(source).text
    assert fixed == (
        "import torch\r\nname = 'é'  # naïve\r\nx = 'é'; s = torch.amp.GradScaler('cuda')\r\n"
    )
    loop = (
        "import torch\r\nscaler = torch.amp.GradScaler('cuda')\r\nfor x in xs:\r\n"
        "    scaler.scale(f(x)).backward()\r\n    scaler.step(opt)\r\n"
    )
    assert fix_source(loop).text == loop + "    scaler.update()\r\n"


LEFT_ALONE = {
    # the imported name is used for more than calls the fix rewrites
    "AG206": "from torch.cuda.amp import GradScaler\nscaler = GradScaler()\nprint(GradScaler)\n",
    # an explicit weights_only=False is the author's call; a pickled model needs it
    "AG208": (
        "import torch\nx = torch.load('a.pt', weights_only=False)\n"
        "ckpt = torch.load('c.pt')\nmodel = ckpt['model'].float()\n"
    ),
    # update() on every micro-batch: moving it is not mechanical
    "AG204": (
        "import torch\nscaler = torch.amp.GradScaler('cuda')\n"
        "for i, x in enumerate(loader):\n    scaler.scale(model(x)).backward()\n"
        "    if (i + 1) % 4 == 0:\n        scaler.step(opt)\n        opt.zero_grad()\n"
        "    scaler.update()\n"
    ),
    # a clip on the same line as other code: no line to insert before
    "AG201": (
        "import torch\nscaler = torch.amp.GradScaler('cuda')\nfor x in loader:\n"
        "    scaler.scale(model(x)).backward()\n"
        "    if ok: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    scaler.step(opt)\n    scaler.update()\n"
    ),
}


def test_a_fallback_for_old_torch_is_left_alone() -> None:
    source = (
        "import torch\ntry:\n    from torch.amp import GradScaler\nexcept ImportError:\n"
        "    from torch.cuda.amp import GradScaler\nscaler = GradScaler()\n"
        "if hasattr(torch.amp, 'autocast'):\n    ctx = torch.amp.autocast('cuda')\nelse:\n"
        "    ctx = torch.cuda.amp.autocast()\n"
    )
    found = [f for f in lint_source(source, torch_version="2.4") if f.code == "AG206"]
    assert found and all(f.evidence.get("fallback") for f in found)
    result = fix_source(source, torch_version="2.4")
    assert (result.text, result.changed) == (source, False)


@pytest.mark.parametrize("code", sorted(LEFT_ALONE))
def test_what_is_not_mechanical_is_left_alone(code: str) -> None:
    source = LEFT_ALONE[code]
    assert code in {f.code for f in lint_source(source, torch_version="2.4")}
    result = fix_source(source, torch_version="2.4")
    assert (result.text, result.changed, result.fixed) == (source, False, [])


def test_select_limits_the_fixes() -> None:
    source = (
        "import torch\ns = torch.cuda.amp.GradScaler()\nmodel.load_state_dict(torch.load('m.pt'))\n"
    )
    only = fix_source(source, select="AG208", torch_version="2.4")
    assert only.text == source.replace("'m.pt')", "'m.pt', weights_only=True)")
    assert [f.code for f in only.fixed] == ["AG208"]


def test_fix_source_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="text must be str"):
        fix_source(b"import torch\n")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="select"):
        fix_source("x = 1\n", select="AG999")


def test_diff_prints_a_unified_diff_and_writes_nothing(tmp_path: Path) -> None:
    _, source, expected, _ = CASES["ag206_call"]
    target = tmp_path / "train.py"
    target.write_bytes(source.encode())
    before = target.stat().st_mtime_ns
    result = lint_cli("--diff", ".", cwd=tmp_path)
    assert result.returncode == 1
    assert target.read_bytes() == source.encode() and target.stat().st_mtime_ns == before
    assert result.stdout.startswith("--- a/train.py\n+++ b/train.py\n@@ ")
    assert "-scaler = torch.cuda.amp.GradScaler(enabled=use_amp)" in result.stdout
    assert '+scaler = torch.amp.GradScaler("cuda", enabled=use_amp)' in result.stdout
    assert "would fix 1 finding(s) in 1 file(s)" in result.stderr
    target.write_text(expected)
    clean = lint_cli("--diff", ".", cwd=tmp_path)
    assert (clean.returncode, clean.stdout) == (0, "")


def test_fix_writes_and_reports_what_is_left(tmp_path: Path) -> None:
    source = (
        "\ufeffimport torch\r\nscaler = torch.cuda.amp.GradScaler()\r\n"
        "x = torch.load('a.pt', weights_only=False)\r\n"
    )
    target = tmp_path / "train.py"
    target.write_bytes(source.encode("utf-8"))
    result = lint_cli("--fix", "train.py", cwd=tmp_path)
    assert result.returncode == 1  # the AG208 warning is left
    assert target.read_bytes() == source.replace(
        "torch.cuda.amp.GradScaler()", "torch.amp.GradScaler('cuda')"
    ).encode("utf-8")  # BOM and CRLF kept
    assert [line.split()[1] for line in result.stdout.splitlines() if line[:1] != " "] == ["AG208"]
    assert "fixed 1 finding(s) in 1 file(s)" in result.stderr


def test_fix_paths_from_python(tmp_path: Path) -> None:
    _, source, expected, _ = CASES["ag204"]
    (tmp_path / "a.py").write_text(source)
    (tmp_path / "b.py").write_text("x = 1\n")
    [dry] = fix_paths([tmp_path], write=False)
    assert (tmp_path / "a.py").read_text() == source and dry.text == expected
    assert unified_diff(dry).count("\n+    scaler.update()") == 1
    [done] = fix_paths(tmp_path)
    assert (tmp_path / "a.py").read_text() == expected and done.path.endswith("a.py")
    assert fix_paths(tmp_path) == []
    assert not [f for f in lint_paths([tmp_path]) if f.code == "AG204"]


def test_fix_and_diff_import_no_torch(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(CASES["ag206_from_import"][1])
    code = (
        "import sys\nfrom ampguard.cli import main\n"
        "for flag in ('--diff', '--fix'):\n"
        "    try:\n        main(['lint', flag, sys.argv[1]])\n"
        "    except SystemExit:\n        pass\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "False"
    assert "from torch.amp import GradScaler, autocast" in (tmp_path / "t.py").read_text()
