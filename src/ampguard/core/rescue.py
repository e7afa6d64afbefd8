"""Stagnation rescue: run the optimizer step of bf16/fp16 weights in fp32 and write it back
without losing the part below half an ulp.

Any ``torch.optim`` optimizer: a step pre-hook swaps each covered parameter's ``.data`` (and its
gradient and its low-precision state tensors, ``exp_avg``, ``exp_avg_sq``...) to fp32 copies, the
optimizer's own step runs on them unchanged (its decoupled weight decay too, so it is applied in
fp32), and a step post-hook writes the new fp32 value back into the parameter's own storage:

- ``"kahan"``: through a compensation buffer (:func:`~ampguard.core.rounding.kahan_write`: int16,
  the fp32 spacings from the stored weight to the value, so the pair holds the fp32 value
  exactly; the next step starts from it): 2 bytes per element;
- ``"stochastic"``: by stochastic rounding (a generator this object owns): nothing persistent;
- ``"nearest"``: plain rounding (a parameter covered only to keep its optimizer states in fp32).

Optimizer states go back to the dtype they had (what the optimizer would have kept: their own
EMA updates round as before) unless ``fp32_states`` keeps them in fp32 (4 bytes per element
instead of 2; an optimizer's ``load_state_dict`` then loads them in fp32 too). A parameter that
is not covered is never touched: its cost is zero.

On the rescue's sampled steps (its first, then every :data:`~ampguard.core.stagnation.SAMPLE_EVERY`)
it measures the share of the intended update that reached the stored value: ``<written,
intended> / <intended, intended>`` per parameter, with ``intended`` the fp32 step and
``written`` the change of the value the weight (and its buffer) holds; 1.0 when nothing is lost
(stochastic rounding: in expectation). Counted on the device; :meth:`Rescue.applied` reads it
(one host sync).

The covered parameters of an optimizer step as groups, one per dtype and device, each written
back by a few multi-tensor and flat operations, with one random draw when stochastic rounding
is among them (:mod:`ampguard.core.rescue_step`); a parameter without a gradient is skipped, as
the optimizer skips it. Cost, per covered element and step: the fp32 copies of the weight,
gradient and states (freed after the step) and a few elementwise passes; per group about ten
operations; no host sync. Persistent: the Kahan buffers (one flat int16 tensor per group, 2
bytes per element), and fp32 states when asked for.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any

import torch

from ampguard._util.stack import user_stacklevel
from ampguard.core.rescue_step import GroupPlan, GroupStep, float_state, plan_groups
from ampguard.core.rounding import COMP_DTYPE, kahan_buffer, kahan_read
from ampguard.core.stagnation import LOW_PRECISION, SAMPLE_EVERY

__all__ = ["METHODS", "RESCUE_SHARE", "KAHAN_BUDGET", "Rescue", "closure_only", "SEED"]

METHODS = ("kahan", "stochastic", "nearest")
# "auto" rescues a layer once at least this share of its intended updates rounded away (AG175's
# measurement); a quarter already slows training measurably, half is AG175's own threshold
RESCUE_SHARE = 0.25
# "auto" gives Kahan buffers (2 bytes per element) to the worst layers while their bytes stay
# within this share of what fp32 master weights would cost (4 bytes per low-precision element),
# the other rescued layers get stochastic rounding (nothing persistent)
KAHAN_BUDGET = 0.25
SEED = 0x5EED  # the stochastic-rounding generator's seed (its state is saved and resumed)
_ATTACHED: weakref.WeakKeyDictionary[Any, Rescue] = weakref.WeakKeyDictionary()


def closure_only(opt: torch.optim.Optimizer) -> bool:
    """True when ``opt.step`` needs a closure (L-BFGS): it re-evaluates the loss itself, so its
    step cannot run on swapped fp32 copies."""
    try:
        param = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


class Rescue:
    """The step hooks over ``params`` (the low-precision parameters of ``optimizers``).

    :meth:`cover` assigns a method to parameters (by index into :attr:`params`); uncovered ones
    are left alone. :meth:`abort` puts the low-precision tensors back after a step that raised.
    :meth:`state_dict` / :meth:`load_state_dict` carry the methods, the Kahan buffers and the
    generator, so a resumed run continues bitwise.
    """

    def __init__(
        self,
        optimizers: list[torch.optim.Optimizer],
        params: list[torch.Tensor],
        *,
        fp32_states: bool = False,
        every: int = SAMPLE_EVERY,
    ) -> None:
        self.params = [p for p in params if p.dtype in LOW_PRECISION]
        self.optimizers = list(optimizers)
        self.fp32_states = fp32_states
        self.every = every
        self.methods: dict[int, str] = {}
        self.comp: dict[int, torch.Tensor] = {}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        dev = self.params[0].device if self.params else torch.device("cpu")
        self.generator = torch.Generator(device=dev).manual_seed(SEED)
        self._applied = torch.zeros(len(self.params), 2, dtype=torch.float64, device=dev)
        self._steps: dict[int, list[GroupStep]] = {}  # optimizer -> its step in flight
        self._loading: dict[int, torch.Tensor] = {}  # low-precision data during a state load
        self._plans: dict[int, tuple[Any, list[GroupPlan]]] = {}
        self._layout_epoch = 0  # bumped when the methods change: the plans are rebuilt
        self._fresh: set[int] = set()  # covered since their last step: measured on the next
        self._opt = {id(opt): k for k, opt in enumerate(optimizers)}
        self._calls = [0] * len(optimizers)
        self.samples = 0
        self._handles: list[Any] = []
        for opt in optimizers:  # one rescue per optimizer: two would swap each other's tensors
            old = _ATTACHED.get(opt)
            if old is not None and old is not self and old.attached:
                warnings.warn(
                    f"a previous stagnation rescue on this {type(opt).__name__} was detached (its "
                    "Kahan buffers rounded into the weights): one Guard rescues an optimizer",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
                old.close()
            _ATTACHED[opt] = self
            self._handles.append(opt.register_step_pre_hook(self._pre))
            self._handles.append(opt.register_step_post_hook(self._post))
            if fp32_states:
                self._handles.append(opt.register_load_state_dict_pre_hook(self._load_pre))
                self._handles.append(opt.register_load_state_dict_post_hook(self._load_post))

    # ------------------------------------------------------------------ configuration
    def index_of(self, p: torch.Tensor) -> int | None:
        """The index of ``p`` in :attr:`params`, or None (not a low-precision parameter)."""
        return self._index.get(id(p))

    def cover(self, indices: list[int], method: str) -> None:
        """Rescue ``params[i]`` for each ``i`` with ``method`` from the next step on (a Kahan
        buffer starts at zero). Cost: the buffers' allocation."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self._layout_epoch += 1
        for i in indices:
            self.methods[i] = method
            self._fresh.add(i)
            if method == "kahan" and i not in self.comp:
                self.comp[i] = kahan_buffer(self.params[i])
            elif method != "kahan":
                self._fold(i)

    def _fold(self, i: int) -> None:
        """Drop parameter ``i``'s Kahan buffer, rounding what it held into the weight."""
        comp = self.comp.pop(i, None)
        if comp is not None:
            with torch.no_grad():
                self.params[i].copy_(kahan_read(self.params[i], comp))

    def persistent_bytes(self) -> int:
        """Bytes the rescue keeps between steps: the Kahan buffers (fp32 states are counted by
        :meth:`state_bytes`)."""
        return sum(c.numel() * c.element_size() for c in self.comp.values())

    @property
    def attached(self) -> bool:
        """True while the step hooks are on the optimizers (until :meth:`close`)."""
        return bool(self._handles)

    def close(self) -> None:
        """Remove the hooks (the buffers' content is folded into the weights)."""
        for i in list(self.comp):
            self._fold(i)
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ the step hooks
    def _plans_of(self, opt: torch.optim.Optimizer, key: int) -> list[GroupPlan]:
        """``opt``'s :class:`~ampguard.core.rescue_step.GroupPlan` s, cached until the methods
        change (:meth:`cover`, a load) or ``opt.param_groups`` change size."""
        stamp = (self._layout_epoch, tuple(len(g["params"]) for g in opt.param_groups))
        cached = self._plans.get(key)
        if cached is None or cached[0] != stamp:
            cached = (stamp, plan_groups(opt, self._index, self.methods, self.comp))
            self._plans[key] = cached
        return cached[1]

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        key = self._opt.get(id(opt))
        if key is None or key in self._steps:
            return
        self._calls[key] += 1
        calls = self._calls[key]
        measure: bool | set[int] = calls == 1 or calls % self.every == 0 or self._fresh
        steps: list[GroupStep] = []
        with torch.no_grad():
            for plan in self._plans_of(opt, key):
                if not any(p.grad is not None for p in plan.params):
                    continue  # the optimizer skips them: so does the rescue
                step = GroupStep(plan, opt.state, self.fp32_states, measure)
                try:
                    step.swap_in()
                except BaseException:
                    for done in steps:
                        done.restore()
                        done.finish()
                    raise
                steps.append(step)
                self._fresh.difference_update(step.indices)
        self._steps[key] = steps

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        key = self._opt.get(id(opt))
        steps = self._steps.pop(key, None) if key is not None else None
        if not steps:
            return
        with torch.no_grad():
            for step in steps:
                for i, sums in step.write_back(self.generator):
                    self._applied[i] += sums
                    self.samples += 1
                step.finish()

    def abort(self) -> None:
        """A step raised between the hooks: put the low-precision tensors back unchanged (the
        failed step's fp32 work is dropped)."""
        with torch.no_grad():
            for steps in self._steps.values():
                for step in steps:
                    step.restore()
                    step.finish()
        self._steps.clear()

    # ------------------------------------------------------------------ fp32 states on load
    def _load_pre(self, opt: torch.optim.Optimizer, state_dict: Any) -> None:
        # torch casts a loaded state to its parameter's dtype: let it see fp32 parameters
        for group in opt.param_groups:
            for p in group["params"]:
                i = self._index.get(id(p))
                if i is not None and i not in self._loading:
                    self._loading[i] = p.data
                    p.data = p.data.float()

    def _load_post(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                i = self._index.get(id(p))
                data = self._loading.pop(i, None) if i is not None else None
                if data is not None:
                    p.data = data

    # ------------------------------------------------------------------ measurement
    def applied(self) -> dict[int, float]:
        """Per covered, sampled parameter index: the share of the intended fp32 update that
        reached the stored value. Cost: one host sync."""
        rows = self._applied.tolist()
        return {i: (num / den if den else 1.0) for i, (num, den) in enumerate(rows) if den}

    def sums(self) -> list[tuple[float, float]]:
        """Per parameter index: ``(<written, intended>, <intended, intended>)`` summed over the
        sampled steps. Cost: one host sync."""
        return [(float(a), float(b)) for a, b in self._applied.tolist()]

    def state_bytes(self) -> int:
        """Bytes of the covered parameters' optimizer states held in fp32 beyond what their
        parameter's dtype would take (0 unless ``fp32_states``). Cost: reads dtypes."""
        if not self.fp32_states:
            return 0
        covered = {id(self.params[i]): self.params[i].element_size() for i in self.methods}
        extra = 0
        for opt in self.optimizers:
            for p, state in opt.state.items():
                size = covered.get(id(p))
                if size is None:
                    continue
                for v in state.values():
                    if float_state(v) and v.dtype == torch.float32:
                        extra += v.numel() * (4 - size)
        return extra

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The methods, the Kahan buffers (tensors), the generator and the measurement."""
        return {
            "methods": {str(i): m for i, m in self.methods.items()},
            "comp": {str(i): c.clone() for i, c in self.comp.items()},
            "generator": self.generator.get_state(),
            "applied": self._applied.clone(),
            "calls": list(self._calls),
            "samples": self.samples,
        }

    def check_state(self, state: Any) -> dict[str, Any]:
        """``ValueError`` naming the field when ``state`` does not fit these parameters;
        nothing is changed."""
        if not isinstance(state, dict):
            raise ValueError(f"malformed Guard state: 'rescue' must be a dict, got {state!r:.80}")
        methods = state.get("methods")
        comp = state.get("comp")
        if not isinstance(methods, dict) or not isinstance(comp, dict):
            raise ValueError("malformed Guard state: 'rescue.methods'/'rescue.comp' must be dicts")
        n = len(self.params)
        for key, m in methods.items():
            if not str(key).isdigit() or int(key) >= n or m not in METHODS:
                raise ValueError(
                    f"malformed Guard state: 'rescue.methods' entry {key!r}: {m!r} does not fit "
                    f"{n} low-precision parameter(s) and the methods {METHODS}"
                )
        for key, c in comp.items():
            i = int(key) if str(key).isdigit() else -1
            p = self.params[i] if 0 <= i < n else None
            if p is None or not isinstance(c, torch.Tensor) or c.shape != p.shape:
                raise ValueError(f"malformed Guard state: 'rescue.comp' entry {key!r} does not fit")
            if c.dtype != COMP_DTYPE:
                raise ValueError(
                    f"malformed Guard state: 'rescue.comp' entry {key!r} is {c.dtype}, a Kahan "
                    f"buffer is {COMP_DTYPE} (fp32 spacings from its weight)"
                )
        if not isinstance(state.get("generator"), torch.Tensor):
            raise ValueError("malformed Guard state: 'rescue.generator' must be a tensor")
        applied = state.get("applied")
        if not isinstance(applied, torch.Tensor) or applied.shape != self._applied.shape:
            raise ValueError("malformed Guard state: 'rescue.applied' does not fit")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a checked :meth:`state_dict` (see :meth:`check_state`)."""
        self._layout_epoch += 1
        self.methods = {int(k): m for k, m in state["methods"].items()}
        self.comp = {
            int(k): c.to(self.params[int(k)].device).clone() for k, c in state["comp"].items()
        }
        self.generator.set_state(state["generator"])
        self._applied.copy_(state["applied"])
        calls = state.get("calls")
        if isinstance(calls, list) and len(calls) == len(self._calls):
            self._calls = [int(c) for c in calls]
        self.samples = int(state.get("samples", 0))
