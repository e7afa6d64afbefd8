"""Name resolution: imports, aliases, assignments and self attributes reach the rules."""

from __future__ import annotations

import pytest

from ampguard.lint import lint_source


def codes(src: str) -> list[str]:
    return [f.code for f in lint_source(src)]


@pytest.mark.parametrize(
    "src",
    [
        "from torch.cuda import amp\ns = amp.GradScaler()\n",
        "import torch.cuda.amp as A\ns = A.GradScaler()\n",
        "from torch.cuda.amp import GradScaler as GS\ns = GS()\n",
        "import torch\nGS = torch.cuda.amp.GradScaler\ns = GS()\n",
        "from torch.cuda.amp import *\ns = GradScaler()\n",
        "from torch.cuda.amp.grad_scaler import GradScaler\ns = GradScaler()\n",
        "def f():\n    from torch.cuda import amp\n    return amp.autocast()\n",
    ],
)
def test_deprecated_spellings_resolve_through_imports_and_aliases(src: str) -> None:
    assert codes(src) == ["AG206"]


def test_a_local_name_shadowing_an_import_is_not_torch() -> None:
    src = (
        "from torch.cuda.amp import autocast\n"
        "def f(autocast):\n"
        "    with autocast():\n"
        "        pass\n"
    )
    assert codes(src) == []


def test_self_attribute_scaler_is_tracked_across_methods() -> None:
    src = (
        "import torch\n"
        "class T:\n"
        "    def __init__(self):\n"
        "        self.amp_scaler = torch.amp.GradScaler()\n"
        "    def step(self, loss, opt, params):\n"
        "        self.amp_scaler.scale(loss).backward()\n"
        "        torch.nn.utils.clip_grad_norm_(params, 1.0)\n"
        "        self.amp_scaler.step(opt)\n"
        "        self.amp_scaler.update()\n"
    )
    assert codes(src) == ["AG201"]


def test_helper_parameters_are_renamed_to_the_callers_arguments() -> None:
    src = (
        "import torch\n"
        "s = torch.amp.GradScaler()\n"
        "def finish(sc, o):\n"
        "    sc.step(o)\n"
        "def loop(data, opt):\n"
        "    for x in data:\n"
        "        s.scale(x).backward()\n"
        "        finish(s, opt)\n"
        "        opt.step()\n"
        "        s.update()\n"
    )
    assert codes(src) == ["AG202"]


def test_partial_autocast_alias_carries_its_dtype() -> None:
    src = (
        "import torch\nfrom functools import partial\n"
        "amp = partial(torch.autocast, device_type='cuda', dtype=torch.bfloat16)\n"
        "scaler = torch.amp.GradScaler()\n"
        "with amp():\n    loss = f()\n"
    )
    assert codes(src) == ["AG203"]


def test_dtype_through_a_single_assignment() -> None:
    src = (
        "import torch\namp_dtype = torch.bfloat16\n"
        "scaler = torch.amp.GradScaler('cuda')\n"
        "with torch.autocast('cuda', dtype=amp_dtype):\n    pass\n"
    )
    assert codes(src) == ["AG203"]


def test_context_manager_assigned_to_a_name_is_an_autocast_region() -> None:
    src = (
        "import torch\nimport torch.nn.functional as F\n"
        "ctx = torch.autocast('cuda', dtype=torch.float16)\n"
        "with ctx:\n    loss = F.binary_cross_entropy(p, y)\n"
    )
    assert codes(src) == ["AG210"]
