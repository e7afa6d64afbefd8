"""Human text for a :class:`~ampguard.forensics.Diagnosis`: titles, explanations and fixes."""

from __future__ import annotations

from typing import Any

from ampguard import precisions
from ampguard.findings.codes import lookup
from ampguard.forensics import _optimizer
from ampguard.forensics._fixcheck import eps_text, keep_fp32_text
from ampguard.forensics._silent import REL_ERROR

__all__ = ["explain", "title_for", "fix_for", "where"]


def _g(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def where(module: str | None, source: str | None = None) -> str:
    """``'blocks.1.fc'``, ``the root module ('')`` or ``code outside the model (loss_fn)`` (with
    the line that ran it, when known)."""
    if module is None:
        return f"the loss code at {source}" if source else "code outside the model (loss_fn)"
    return "the root module ('')" if module == "" else repr(module)


def title_for(d: Any) -> str:
    """One line that starts with the code's catalogue title, e.g. ``fp16 overflow in the forward
    pass at 'blocks.2.fc'`` (a bf16 run: ``fp16 overflow (bf16) in ...``)."""
    if d.kind in _optimizer.KINDS:  # phase "optimizer" (locate(..., optimizer=))
        return _optimizer.title(d)
    low = d.precision
    at = f" at {where(d.module)}" if d.module is not None or d.op else ""
    head = lookup(d.code).title
    if d.benign:
        return f"{head}{at}"
    entry = precisions.REGISTRY.get(low)
    fp16_range = entry is not None and entry.low_dtype == "float16"  # what the titles name
    if d.kind in ("fp16_overflow", "fp16_underflow", "fp16_overflow_absorbed") and not fp16_range:
        head += f" ({low})"
    return (
        head
        + {
            "none": "",
            "fp16_overflow": f" in the {d.phase or 'training'} pass{at}",
            "fp16_underflow": f": gradients flushed to zero{at}",
            "fp16_overflow_absorbed": f"{at} ({d.op})",
            "model_nonfinite": at,
            "input_nonfinite": at,
        }[d.kind]
    )


def fix_for(d: Any) -> str:
    """The concrete fix for this kind."""
    if d.kind in _optimizer.KINDS:
        return _optimizer.fix(d)
    if d.kind == "model_nonfinite" and d.stats.get("broken_before_step"):
        return (
            "Reset or reload the non-finite buffers (BatchNorm: module.reset_running_stats(), "
            "or the last good checkpoint) and keep Guard(restore_buffers_on_skip=True), so a "
            "skipped step cannot poison them again."
        )
    if d.kind == "model_nonfinite" and d.phase == "optimizer":
        return (
            "Restore the last good checkpoint; then find what the optimizer step wrote: a "
            "learning rate too high, or with fp16/bf16 weights an eps their dtype cannot hold "
            "(ampguard.locate(model, loss_fn, batch, optimizer=opt) checks it)."
        )
    if d.module is None and d.op and not d.benign and d.kind.startswith("fp16_"):
        return _loss_code_fix(d)
    if d.module == "" and d.op and not d.benign and d.kind.startswith("fp16_"):
        return _root_fix(d)
    target = d.module if d.module is not None else "<module>"
    flushed = (d.stats.get("flushed_by") or {}).get("module")
    if d.benign:
        return (
            "Nothing to fix: the scaler skips this step and lowers the scale. If probes recur "
            "often, cap ScalerConfig(max_scale=...) near the largest safe scale or lengthen "
            "growth_interval."
        )
    return {
        "none": "Nothing to fix.",
        "fp16_overflow": keep_fp32_text(d)
        or (
            f"Keep {where(d.module)} in fp32: Guard(..., keep_fp32=[{target!r}]) or "
            "Guard(..., auto_fallback=True); or train in bf16 (precision='bf16'); "
            "or bound the values (normalisation, clamping, smaller init or LR)."
        ),
        "fp16_overflow_absorbed": (
            f"Keep {where(d.module)} in fp32: Guard(..., keep_fp32=[{target!r}]) or "
            "Guard(..., auto_fallback=True); or train in bf16 (precision='bf16'); or "
            f"normalise before {d.op} (subtract the mean and divide by a max before squaring, "
            "or use torch.nn.LayerNorm / F.layer_norm, which autocast runs in fp32). A larger "
            "or smaller loss scale does not help: the overflow is in the forward pass."
        ),
        "fp16_underflow": _underflow_fix(d, flushed)
        if "underflow_share" in d.stats or "rel_error" in d.stats
        else (
            "Raise the loss scale (ScalerConfig(init_scale=..., min_scale=...)), "
            f"keep {where(flushed if flushed is not None else d.module)} in fp32 "
            "(keep_fp32=[...]), or train in bf16 (precision='bf16')."
        ),
        "model_nonfinite": (
            "Fix the model's math, not the precision: clamp inputs of log/sqrt/"
            "pow/div, add an eps, check the data and the learning rate; restore "
            "the last good checkpoint if the weights are already non-finite."
        ),
        "input_nonfinite": (
            "Clean the data: find where the loader produces NaN/inf (check "
            "torch.isfinite(x).all() per batch) and fix or drop those samples."
        ),
    }[d.kind]


def explain(d: Any) -> str:
    """A few sentences: what happened, where, the evidence and the fix."""
    if d.kind in _optimizer.KINDS:
        return _optimizer.explain(d)
    s = d.stats
    low = d.precision
    at = (
        f"{d.op} in {where(d.module, s.get('source'))}"
        if d.op
        else where(d.module, s.get("source"))
    )
    if d.module == "" and d.op:  # name what fed the op, not just "the root"
        own = ", ".join(map(repr, (s.get("root_parameters") or [])[:4]))
        at = f"{d.op} in the root module's own forward code" + (
            f" (its own parameters: {own})" if own else " (no parameter of its own: its inputs)"
        )
    counts = (
        "non-finite values"
        if s.get("inf_count") is None
        else f"{s.get('inf_count')} inf and {s.get('nan_count')} NaN values"
    )
    if d.benign:
        text = (
            f"Benign: the backward pass overflows {low} at loss scale {_g(d.scale)} "
            f"({at}), but the same batch is finite at scale 1 and in fp32. This is only the "
            f"loss scaler probing its level (largest safe scale about "
            f"{_g(s.get('max_safe_scale'))}); the step is skipped and the scale lowered."
        )
    elif d.kind == "none":
        text = (
            f"Loss and gradients are finite in {low} at loss scale {_g(d.scale)} and no "
            "layer's gradients flush to zero: mixed precision is fine for this batch."
        ) + _rounding_note(s)
    elif d.kind == "fp16_overflow":
        text = _overflow(d, at, counts) + _poisoned(s)
    elif d.kind == "fp16_underflow":
        text = _underflow(d, at)
    elif d.kind == "fp16_overflow_absorbed":
        text = _absorbed(d, at, counts)
    elif d.kind == "model_nonfinite":
        if "nonfinite_tensors" in s:
            text = _broken_state(d)
        else:
            text = (
                f"fp32 goes non-finite too: in the {d.phase} pass {at} produced {counts} "
                "from finite inputs even in fp32. This is not an AMP problem; no precision "
                "setting fixes it."
            )
    else:
        paths = ", ".join(b["path"] for b in s.get("inputs", [])[:5])
        text = (
            f"The batch itself holds {s.get('nan_count', 0)} NaN and {s.get('inf_count', 0)} "
            f"inf values ({paths}); the first module to consume them is {at}."
        )
    if s.get("replay_reproduced") is False:
        text = (
            "The replay did not reproduce the failing step: its loss was NaN/inf in training "
            f"but is {_g(s.get('replay_loss'))} in the replay (the batch or the model changed "
            "between the step and the replay, loss_fn draws its own randomness, or an op is "
            f"non-deterministic), so what follows describes the replay, not the step. {text}"
        )
    stopped = s.get("fallback_stopped")
    halt = (
        f" auto_fallback stopped here: after it kept {stopped['first_fallback']!r} in fp32 "
        f"(step {stopped['step']}), {stopped['reason']}."
        if stopped
        else ""
    )
    return f"{text}{_probe_note(s)}{_mask_note(s)}{halt} Fix: {fix_for(d)}"


def _mask_note(s: dict[str, Any]) -> str:
    """Which dropout mask the replays ran, and whether another gives another answer."""
    info = s.get("dropout")
    if not info:
        return ""
    mods = ", ".join(map(repr, info["modules"][:4]))
    other = info.get("with_global_rng_mask") or info.get("without_dropout")
    run = "the global RNG mask" if "with_global_rng_mask" in info else "dropout off"
    differs = (
        f"; the other run ({run}) says {other['code']} at {where(other['module'])}"
        if other and info.get("stable") is False
        else ""
    )
    return f" Dropout ({mods}): mask {info['mask']}{differs}."


def _probe_note(s: dict[str, Any]) -> str:
    """A scaler probe found in the same batch as a real finding: said, never in its place."""
    probe = s.get("scaler_probe")
    if not probe:
        return ""
    return (
        f" (At loss scale {_g(probe['scale'])} the backward of {where(probe['module'])} also "
        f"overflows: only the scaler probing, it settles near {_g(probe['max_safe_scale'])}; "
        "the finding above is what stays wrong at that scale.)"
    )


def _overflow(d: Any, at: str, counts: str) -> str:
    s = d.stats
    low = d.precision
    ref = s.get("max_abs_fp32")
    limit = _g(s.get("limit"))
    if d.phase == "forward" and d.op == "aten._to_copy":
        return (
            f"In the forward pass autocast in {where(d.module)} cast a tensor of max |x| = "
            f"{_g(s.get('input_max_abs_' + low))} (one of its weights or inputs) down to "
            f"{s.get('dtype')} and it overflowed ({counts}, shape {s.get('shape')}): the "
            f"value is beyond {low}'s largest value {limit}; fp32 stays finite."
        )
    if d.phase == "forward":
        head = (
            f"In the forward pass {at} produced {counts} ({s.get('dtype')}, shape "
            f"{s.get('shape')}) from finite inputs."
        )
        limit_value = s.get("limit")
        if isinstance(ref, float) and isinstance(limit_value, float) and ref <= limit_value:
            return (
                f"{head} In fp32 the same op reaches only max |x| = {_g(ref)}, which fits "
                f"{low}: one of its inputs lost its value in {low} (a small value rounded to "
                f"zero, then divided by), so the op is non-finite only in {low}."
                + eps_text(s.get("tiny_eps") or [])
            )
        return (
            f"{head} In fp32 the same op reaches max |x| = {_g(ref)}, beyond {low}'s largest "
            f"value {limit}; fp32 stays finite, so this is a {low} range overflow."
            + eps_text(s.get("tiny_eps") or [])
        )
    if d.op == "aten._to_copy":
        what = (
            f"a gradient of max |x| = {_g(s.get('input_max_abs_' + low))} was cast down to "
            f"the {s.get('dtype')} of an activation made by {where(d.module)} and overflowed "
            f"({counts}, shape {s.get('shape')})"
        )
    else:
        what = (
            f"the gradient made by {at} overflowed {low} ({counts}, {s.get('dtype')}, shape "
            f"{s.get('shape')}); fp32 reaches max |x| = {_g(ref)} there, in the same units, "
            "and stays finite"
        )
    later = s.get("at_scale_1")
    also = (
        f" At scale 1 it first breaks at {later['op']} in {where(later['module'])}."
        if later and (later["module"], later["op"]) != (d.module, d.op)
        else ""
    )
    return (
        f"In the backward pass, at loss scale {_g(d.scale)}, {what}. The forward pass is "
        f"finite and the overflow persists at loss scale 1, so no loss scale fixes it."
        f"{also}"
    )


def _underflow(d: Any, at: str) -> str:
    s = d.stats
    low = d.precision
    if "underflow_share" in s:
        others = [m for m in s.get("layers", {}) if m != d.module]
        also = f" Other layers above it: {', '.join(map(repr, others[:4]))}." if others else ""
        scaler = (
            "without a loss scaler (scale 1)" if d.scale == 1.0 else f"at loss scale {_g(d.scale)}"
        )
        return (
            f"{low} {scaler} loses {s['underflow_share']:.1%} of the gradient of "
            f"{where(d.module)}: of its {s.get('nonzero_fp32')} gradient elements that are "
            f"nonzero in fp32, {s.get('flushed')} are flushed to zero and "
            f"{s.get('lossy_subnormal')} are {low} subnormals with at most "
            f"{s.get('lossy_bits')} significant bits (threshold {s.get('threshold'):.0%}). "
            f"The loss and the gradients stay finite, so nothing skips: the layer just learns "
            f"from a fraction of its gradient.{also}"
        )
    if "rel_error" in s:
        by = s.get("flushed_by") or {}
        scaler = (
            "without a loss scaler (scale 1)" if d.scale == 1.0 else f"at loss scale {_g(d.scale)}"
        )
        return (
            f"{low} {scaler} gets the gradient of {where(d.module)} {s['rel_error']:.0%} wrong "
            f"(relative L2 error against fp32; threshold {s.get('rel_error_threshold'):.0%}), "
            f"although none of its elements is zero: upstream, {by.get('op')} in "
            f"{where(by.get('module'))} produced backward values below {low}'s smallest "
            "normal value in fp32 too, so the contributions that flushed there are missing "
            "from the sum. This is gradient underflow; nothing skips."
        )
    if "dead_parameters" in s:
        dead = ", ".join(s["dead_parameters"][:4])
        by = s.get("flushed_by")
        origin = f" They were flushed by {by['op']} in {where(by['module'])}." if by else ""
        return (
            f"Gradients of {where(d.module)} are all zero in {low} at loss scale "
            f"{_g(d.scale)} but reach max |g| = {_g(s.get('grad_max_abs_fp32'))} in fp32: a "
            f"dead layer ({dead}).{origin}"
        )
    return (
        f"In the {d.phase} pass {at} produced non-finite values from an input that flushed "
        f"to zero in {low} (its fp32 input max |x| is {_g(s.get('input_max_abs_fp32'))}, "
        f"below {low}'s smallest normal value)."
    )


def _root_fix(d: Any) -> str:
    """An op in the root module's own forward: keep_fp32=[''] would run the whole model in fp32."""
    own = ", ".join(map(repr, (d.stats.get("root_parameters") or [])[:4]))
    fed = f" (fed by {own})" if own else ""
    return (
        f"{d.op} runs in the root module's own forward{fed}, not in a submodule, so "
        "keep_fp32=[''] would put the whole model in fp32: compute that op in fp32 there "
        "(cast its inputs with .float() first, or wrap it in torch.autocast(device_type, "
        "enabled=False)), or move it into a small submodule and keep_fp32 that one; or train "
        "in bf16 (precision='bf16')."
    )


def _loss_code_fix(d: Any) -> str:
    """An op outside every module (the loss code): keep_fp32 cannot reach it; name the op, the
    line, and the fixes that apply there."""
    at = f" at {d.stats['source']}" if d.stats.get("source") else " in loss_fn"
    if d.kind == "fp16_underflow":
        return (
            f"{d.op} runs in the loss code{at}, outside every module, so keep_fp32 cannot reach "
            "it: compute it in fp32 there (cast its inputs with .float() first, or wrap it in "
            "torch.autocast(device_type, enabled=False)), or scale the values up before it; or "
            "train in bf16 (precision='bf16')."
        )
    return (
        f"{d.op} runs in the loss code{at}, outside every module, so keep_fp32 cannot reach it: "
        "compute it in fp32 there (cast its inputs with .float() first, or wrap it in "
        "torch.autocast(device_type, enabled=False)), or rescale before it (divide by the max, "
        "use logsumexp, or F.cross_entropy / F.mse_loss on .float() outputs, which autocast "
        "runs in fp32); or train in bf16 (precision='bf16')."
    )


def _rounding_note(s: dict[str, Any]) -> str:
    """A layer whose gradient is far off fp32's without any underflow: said, not called fine."""
    wrong = {m: v for m, v in (s.get("grad_rel_error") or {}).items() if v > REL_ERROR}
    if not wrong:
        return ""
    worst = max(wrong, key=lambda m: wrong[m])
    return (
        f" But the gradient of {where(worst)} is {wrong[worst]:.0%} off fp32's (relative L2 "
        "error) with no value below the smallest normal: rounding, not underflow; compare "
        "keep_fp32 on it or bf16 before trusting this batch's updates."
    )


def _broken_state(d: Any) -> str:
    """Non-finite state before the batch: written by an optimizer step (parameters), or buffers
    broken before this step (the batch itself replays clean)."""
    names = ", ".join(d.stats["nonfinite_tensors"][:5])
    if d.stats.get("broken_before_step"):
        return (
            f"The model's buffers are non-finite ({names}) while its parameters are finite, and "
            "this batch replays clean in low precision and fp32: they were broken before this "
            "step (an earlier forward, or a skipped step whose buffers were not restored: "
            "Guard(restore_buffers_on_skip=True) is the default), not by this batch. Eval reads "
            "them: it is NaN while training looks fine."
        )
    where_ = " by an optimizer step" if d.phase == "optimizer" else ""
    return (
        f"The model's state is already non-finite before this batch: {names} hold NaN/inf, "
        f"written{where_} (parameters change only there). Pass optimizer= to locate to check "
        "whether its eps underflows the weights' dtype."
    )


def _poisoned(s: dict[str, Any]) -> str:
    bad = s.get("poisoned_buffers")
    if not bad:
        return ""
    return (
        f" This forward also wrote the overflow into buffers ({', '.join(bad[:5])}): a skipped "
        "step must restore them (Guard(restore_buffers_on_skip=True), the default), or every "
        "later eval is NaN."
    )


def _underflow_fix(d: Any, flushed: Any) -> str:
    if d.scale == 1.0:
        return (
            "Use a loss scaler: ampguard.Guard(model, optimizer, precision='fp16') (dynamic "
            "scaling) or torch.amp.GradScaler; or train in bf16 (precision='bf16', no scaler "
            "needed)."
        )
    return (
        f"Raise the loss scale (ScalerConfig(init_scale=..., min_scale=...)), keep "
        f"{where(d.module)} in fp32 (keep_fp32=[...]), or train in bf16 (precision='bf16')."
    )


def _absorbed(d: Any, at: str, counts: str) -> str:
    s = d.stats
    low = d.precision
    by = s.get("absorbed_by")
    consumed = (
        f" {by['op']} in {where(by['module'])} turned the inf back into finite values"
        if by
        else " a later op turned it back into finite values"
    )
    return (
        f"In the forward pass {at} overflowed {low} ({counts}, {s.get('dtype')}, shape "
        f"{s.get('shape')}) from finite inputs; in fp32 the same op reaches max |x| = "
        f"{_g(s.get('max_abs_fp32'))}, beyond {low}'s largest value {_g(s.get('limit'))}. "
        f"Then{consumed} (e.g. x / sqrt(inf) = 0), so the loss ({_g(s.get('loss'))}; fp32 "
        f"{_g(s.get('loss_fp32'))}) and the gradients stay finite: no step is skipped, but "
        f"the module's output no longer depends on its input and training stalls."
    )
