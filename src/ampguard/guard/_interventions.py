"""The autopsy's interventions: each a counterfactual replay of windows ``t - 1`` and ``t``.

Each function of :func:`interventions` replays window ``t - 1`` with one change and returns the
loss of window ``t`` (``drop_outliers``: window ``t`` without its outlier samples). Each changes
only what its mechanism says is wrong, so that it cannot remove a spike of another cause:

======================  =====================================================================
``drop_outliers``       window ``t`` without its samples whose loss is above 3x the running
                        level of the loss (the detector's; the batch median without one): at
                        least one, at most half (over all its micro-batches)
``fp32_states``         window ``t - 1``'s step with the optimizer states of low-precision
                        parameters in fp32 (``Guard(fp32_optimizer_states=True)``)
``floor_v``             Adam's ``exp_avg_sq`` of the suspect layer raised to the gradient's
                        square where it is below ``(1 - beta2)`` times it (a second moment that
                        decayed, or rounded, to nothing against the gradient it now meets)
``clip_update``         the suspect layers' update at ``t - 1`` clipped to the other layers'
                        median update-to-weight ratio
``fp32_layer``          the suspect layer in fp32 at ``t - 1`` and ``t``
``halve_lr``            the LR of every group halved at ``t - 1``
======================  =====================================================================

Cost: two replayed windows each (``drop_outliers``: one plus a forward per sample); host syncs.
"""

from __future__ import annotations

import torch

from ampguard.forensics.islands import Fp32Islands
from ampguard.guard._replay_run import NotApplicable, Replay, Run, batch_len, index
from ampguard.reporting.postmortem import layer_of

__all__ = ["LOW_STATE", "interventions", "low_precision_states"]

LOW_STATE = (torch.bfloat16, torch.float16)  # optimizer-state dtypes that round


def low_precision_states(optimizers: list[torch.optim.Optimizer], ids: set[int] | None) -> int:
    """How many floating optimizer-state tensors (of the parameters whose ``id`` is in ``ids``;
    None: all) are held in bf16/fp16."""
    n = 0
    for opt in optimizers:
        for p, st in opt.state.items():
            if ids is not None and id(p) not in ids:
                continue
            n += sum(1 for v in st.values() if isinstance(v, torch.Tensor) and v.dtype in LOW_STATE)
    return n


def interventions(
    rep: Replay, step: int, layers: list[str], ratios: dict[str, float]
) -> dict[str, Run]:
    """The interventions for suspect ``layers`` (module names; the first is the main suspect,
    the layer ones act on all of them), by name (see the module docstring)."""
    params = dict(rep.model.named_parameters())
    mine = [n for n in params if layer_of(n) in layers]

    def drop_outliers() -> float:
        g = rep.new_guard()
        rep.window(g, step - 1)
        micro = rep.micro(step)
        sizes = [batch_len(b) for b, _ in micro]
        if any(n is None for n in sizes) or sum(n or 0 for n in sizes) < 2:
            raise NotApplicable("the batch cannot be split by sample")
        per: list[tuple[float, int, int]] = []  # (loss, micro-batch, sample)
        with torch.no_grad(), g.autocast():
            for m, (batch, loss_fn) in enumerate(micro):
                for i in range(sizes[m] or 0):
                    per.append((float(loss_fn(rep.model, index(batch, [i]))), m, i))
        total, level = len(per), rep.rows[step].get("level")
        typical = level if level and level > 0 else sorted(v for v, _, _ in per)[total // 2]
        k = min(max(1, sum(v > 3 * typical for v, _, _ in per)), max(1, total // 2))
        dropped = {(m, i) for _, m, i in sorted(per, key=lambda t: -t[0])[:k]}
        keep = [[i for i in range(n or 0) if (m, i) not in dropped] for m, n in enumerate(sizes)]
        return rep.window(g, step, train=False, keep=keep)

    def fp32_states() -> float:
        if rep.fp32_states:
            raise NotApplicable("the run keeps its optimizer states in fp32 already")
        if not low_precision_states(rep.optimizers, None):
            raise NotApplicable("no optimizer state is held in bf16/fp16")
        g = rep.new_guard(fp32_optimizer_states=True)
        rep.window(g, step - 1)
        return rep.window(g, step, train=False)

    def floor_v() -> float:
        g = rep.new_guard()
        hit: list[int] = []

        def floor() -> None:  # before the step: the state holds window t - 2's moments
            inv = 1.0 / rep.grad_scale(g)
            for opt in rep.optimizers:
                for group in opt.param_groups:
                    beta2 = group.get("betas", (0.9, 0.999))[1]
                    for p in group["params"]:
                        v = opt.state.get(p, {}).get("exp_avg_sq")
                        if id(p) not in ids or p.grad is None or not isinstance(v, torch.Tensor):
                            continue
                        g2 = (p.grad.detach().float() * inv).square()
                        low = v.float() < (1 - beta2) * g2
                        hit.append(int(low.sum()))
                        v.copy_(torch.where(low, g2, v.float()).to(v.dtype))

        ids = {id(params[n]) for n in mine}
        rep.window(g, step - 1, before=floor)
        if not hit:
            raise NotApplicable("the suspect layer has no Adam second moment")
        if not sum(hit):
            raise NotApplicable("no element's second moment is small against its gradient")
        return rep.window(g, step, train=False)

    def clip_update() -> float:
        if not mine:
            raise NotApplicable("no suspect layer")
        g = rep.new_guard()
        others = sorted(v for n, v in ratios.items() if n not in mine)
        median = others[len(others) // 2] if others else 0.0  # the other layers' median
        before = {n: params[n].detach().clone() for n in mine}

        def clip() -> None:
            with torch.no_grad():
                for n in mine:
                    delta = params[n].float() - before[n].float()
                    cap = median * float(before[n].float().norm())
                    norm = float(delta.norm())
                    if norm > cap > 0:
                        params[n].copy_(before[n].float() + delta * (cap / norm))

        rep.window(g, step - 1, after=clip)
        return rep.window(g, step, train=False)

    def fp32_layer() -> float:
        suspect = layers[0] if layers else None
        if suspect is None or rep.guard.policy.entry.is_full:
            raise NotApplicable("the run is fp32 already" if suspect else "no suspect layer")
        if suspect not in dict(rep.model.named_modules()):
            raise NotApplicable(f"{suspect!r} is a parameter of no submodule")
        g = rep.new_guard()
        with Fp32Islands(rep.model) as islands:  # the hooks go when the block ends
            islands.add(suspect)
            rep.window(g, step - 1)
            return rep.window(g, step, train=False)

    def halve_lr() -> float:
        g = rep.new_guard()
        groups = [grp for opt in rep.optimizers for grp in opt.param_groups]
        lrs: list[float] = []

        def half() -> None:  # after the recorded LRs are set
            lrs[:] = [grp["lr"] for grp in groups]
            for grp in groups:
                grp["lr"] *= 0.5

        def back() -> None:
            for grp, lr in zip(groups, lrs, strict=True):
                grp["lr"] = lr

        rep.window(g, step - 1, before=half, after=back)
        return rep.window(g, step, train=False)

    return {
        "drop_outliers": drop_outliers,
        "fp32_states": fp32_states,
        "floor_v": floor_v,
        "clip_update": clip_update,
        "fp32_layer": fp32_layer,
        "halve_lr": halve_lr,
    }
