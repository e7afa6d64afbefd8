"""DeepSpeed on a CPU: the shared-memory allreduce op it JIT-compiles at ``deepspeed.initialize``.

On a machine whose DeepSpeed accelerator is the CPU, ``deepspeed.initialize`` (its
``TorchBackend``) builds the C++ op ``deepspeed_shm_comm`` with ninja the first time: minutes on a
small machine, and a one-process run never uses it. A build killed half-way leaves the lock file
``<torch extensions folder>/deepspeed_shm_comm/lock`` behind, and every later run waits on it
forever. :func:`shm_op_warning` says so before it happens (when ``ampguard.integrations.deepspeed``
is imported before ``deepspeed.initialize``), with the folder and what to do; it never changes
DeepSpeed. ampguard's own DeepSpeed test replaces ``deepspeed.comm.torch.build_shm_op`` with a
function that returns None in its one-process child (``tests/test_deepspeed.py``).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__all__ = ["SHM_OP", "shm_build_folder", "shm_op_warning"]

SHM_OP = "deepspeed_shm_comm"


def shm_build_folder(torch_module: Any) -> str:
    """Where torch builds (and locks) the op: ``$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm`` or
    the default ``~/.cache/torch_extensions/py3X_cpu/deepspeed_shm_comm`` (nothing is
    created, unlike torch's own helper)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        version = torch_module.version
        accel = (
            f"rocm{version.hip.replace('.', '')}"
            if getattr(version, "hip", None)
            else f"cu{version.cuda.replace('.', '')}"
            if version.cuda
            else "cpu"
        )
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{py}_{accel}")
    return os.path.join(root, SHM_OP)


def shm_op_warning() -> str | None:
    """The warning to give now (None: nothing to say): DeepSpeed's accelerator is the CPU, its
    process group is not up yet, ``build_shm_op`` is DeepSpeed's own and the op is not built
    (or a killed build left its lock). Cost: a few ``stat`` calls."""
    try:
        import torch
        from deepspeed import comm
        from deepspeed.accelerator import get_accelerator

        # (``deepspeed.comm.torch`` as an attribute is torch itself: import the submodule)
        ds_torch = importlib.import_module("deepspeed.comm.torch")
    except Exception:  # an older or partial DeepSpeed: nothing to say
        return None
    try:
        if get_accelerator().device_name() != "cpu" or comm.is_initialized():
            return None
    except Exception:
        return None
    builder = getattr(ds_torch, "build_shm_op", None)
    if getattr(builder, "__module__", None) != ds_torch.__name__:
        return None  # replaced by the caller (as ampguard's own test does)
    folder = shm_build_folder(torch)
    lock = os.path.join(folder, "lock")
    if os.path.exists(lock):
        return (
            f"DeepSpeed's CPU op {SHM_OP} has a lock file left by a killed build: {lock}. "
            "deepspeed.initialize will wait on it forever; delete it (no build is running)."
        )
    if os.path.exists(os.path.join(folder, f"{SHM_OP}.so")):
        return None
    return (
        f"DeepSpeed on CPU JIT-compiles its C++ op {SHM_OP} at deepspeed.initialize (minutes "
        f"on a small machine; a one-process run never uses it). A build killed half-way leaves "
        f"{lock}, which makes every later run wait forever: delete it then. To skip the build "
        "in a one-process run, set deepspeed.comm.torch.build_shm_op = lambda: None before "
        "deepspeed.initialize."
    )
