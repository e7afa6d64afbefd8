"""The Guard's window: the forward's context, the backward, and the step at a window's end.

What ``Guard.autocast()``, ``Guard.backward()`` and ``Guard.step()`` run, on the Guard's
:class:`~ampguard.guard._step_state.StepState`: the buffer snapshots of
``restore_buffers_on_skip`` (one per window, one per micro-batch under containment), DDP's
``no_sync()`` for all micro-batches but the window's last, the collectives' peer timeout
(``PeerFailureError``), the loss scaling, the non-finite micro-batch containment, and around
the one step (:mod:`ampguard.guard._step`) what each attached part does before and after it.
Cost: see ``Guard`` (torch's own syncs, no more).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ampguard.core import check_backward, check_grads_present, results
from ampguard.core.containment import MicrobatchBuffer
from ampguard.core.results import StepResult
from ampguard.core.scaler import ScaleCollapseError
from ampguard.guard import _flags, _recipe, _step
from ampguard.guard._step_state import StepState

__all__ = ["backward", "forward", "step"]


@contextlib.contextmanager
def forward(state: StepState) -> Iterator[None]:
    """The forward's context: autocast, DDP's ``no_sync()``, snapshots. Cost: no host sync."""
    traced = state.forensics.session("forward") if state.forensics else contextlib.nullcontext()
    if state.buffer_snapshot is not None and state.micro == 0:  # the window's first forward
        state.buffer_snapshot.take(state.steps + 1)
    if state.micro_snapshot is not None:  # every micro-batch's forward, under containment
        state.micro_snapshot.take(_micro_key(state, state.micro))
    with (
        _peers(state, "the forward's collectives"),
        _grad_sync_context(state),
        state.policy.autocast(),
        traced,
    ):
        yield


def backward(state: StepState, loss: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Backward of ``loss / accumulation_steps`` (times the loss scale). Cost: no host sync."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            "loss must be a single-element tensor (reduce it with .mean() or .sum()), got "
            + (
                f"shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
        )
    check_backward(state.micro, state.accumulation_steps)
    state.window_losses.append(loss.detach())  # a NaN loss is a forward, not an overflow
    if state.telemetry is not None:
        state.telemetry.on_backward(loss)
    if state.dist is not None and state.scaled:
        state.dist.note_loss(loss)  # plain DDP: this rank's overflow origin, no collective
    if state.accumulation_steps > 1:
        loss = loss / state.accumulation_steps
    loss = state.loss_scale.scale_loss(loss)  # the no-op scale: the loss itself
    with _peers(state, "the gradient reduction in backward"):  # DDP/FSDP2 collectives
        if state.forensics is not None:  # armed or coverage windows trace the backward too
            state.forensics.on_loss(loss)
            with state.forensics.session("backward"):
                loss.backward(**kwargs)
        else:
            loss.backward(**kwargs)
    state.micro += 1
    if state.contain_microbatches:
        _contain_microbatch(state)


def step(
    state: StepState,
    guard: object,
    batch: Any,
    loss_fn: Callable[..., torch.Tensor] | None,
    kwargs: dict[str, Any],
) -> StepResult:
    """``Guard.step()``: a micro-batch's end, or the window's step (``guard``: the Guard, for
    the lazy flags and the cross-rank audit). Cost: see ``Guard``."""
    if state.forensics is not None:
        state.forensics.check_replay(batch, loss_fn)
    if state.micro == 0:
        raise RuntimeError("Guard.step() called before Guard.backward(loss) in this window")
    if state.micro < state.accumulation_steps:
        if state.spikes is not None:  # the window's micro-batches, for the autopsy
            state.spikes.on_micro(batch, loss_fn)
        return StepResult.in_window(state.steps, len(state.optimizers))
    tel = state.telemetry
    if tel is not None and tel.flush_due:  # on_write_error="raise": fail before the update
        tel.before_update()
    state.micro = 0
    losses = state.window_losses
    state.loss_bad = results.loss_nonfinite(losses)
    state.window_losses = []
    if not state.contain_microbatches:  # containment buffers hold the grads
        check_grads_present(state.params)  # e.g. another Guard's step() cleared them
    state.steps += 1
    if state.spikes is not None:  # the flight recorder: loss, LRs, the spike flag
        state.spikes.begin(state.steps, losses)
    state.resume.before_step(state.optimizers, state.steps)  # resume warm-up LR ramp
    stagnation = state.stagnation
    if stagnation is not None:  # a sampled window: the weights before the step
        stagnation.before(state.steps)
    try:
        with _peers(state, "Guard.step()", state.steps):  # e.g. FSDP2's grad-norm all-reduce
            result = _step.run(state, guard, kwargs)
        if stagnation is not None and stagnation.sampling(state.steps):
            stagnation.after(state.steps, _step.skip_flag(state, result))  # before zero_grad
        if state.rescue is not None:  # EMA measurement, "auto"'s decision
            state.rescue.after_window(state.steps, _step.skip_flag(state, result), stagnation)
    except BaseException as err:
        if state.rescue is not None:  # a step that raised between the rescue's hooks
            state.rescue.abort()
        if state.telemetry is not None:  # the failed window's loss must not join the next
            state.telemetry.on_abort()
        if state.spikes is not None:  # the flight recorder dumps its ring
            state.spikes.on_error(err, state.steps)
        if state.buffer_snapshot is not None and isinstance(err, ScaleCollapseError):
            state.buffer_snapshot.restore(state.steps)  # the collapsing window was skipped too
        raise
    finally:
        state.resume.after_step(state.steps)
        if state.signatures is not None:  # the next window: hooked only if it is recorded
            state.signatures.window(state.steps)
        # also on an exception: the window's grads are already unscaled/clipped in place and
        # must not leak into the next window
        for opt in state.optimizers:
            opt.zero_grad(set_to_none=True)
    if state.buffer_snapshot is not None:  # before forensics replays the window's batch
        _restore_buffers(state, result)
    if len(state.pending) >= _flags.DRAIN_EVERY:
        _flags.drain(state)
    if state.dist is not None:
        state.dist.maybe_audit(guard)  # cross-rank audit every `audit_every` windows
    if state.forensics is not None:  # diagnose an armed/replayable overflow, fall back
        state.forensics.on_step(result, batch, loss_fn)
    if state.fp8 is not None:  # a per-layer precision re-checks its meter every K steps
        _recipe.after_step(state.fp8, state.steps, batch, loss_fn)
    if state.callbacks and result.applied:
        for fn in state.callbacks:
            fn(result)
    if state.spikes is not None:  # update ratios, the batch, a snapshot (schedulers
        state.spikes.after_step(state, batch, loss_fn)  # stepped: after them)
    return result


def _peers(
    state: StepState, what: str, step: int | None = None
) -> contextlib.AbstractContextManager:
    """A failed collective in the block -> ``PeerFailureError`` naming the ranks; ``step``:
    the window (default: the one in progress)."""
    if state.dist is None:
        return contextlib.nullcontext()
    return state.dist.collectives(what, state.steps + 1 if step is None else step)


def _restore_buffers(state: StepState, result: StepResult) -> None:
    """A skipped window's forward leaves the buffers as they were before it. Cost: no host
    sync (fused optimizers' lazy flags act on the device)."""
    assert state.buffer_snapshot is not None
    skipped = _step.skip_flag(state, result)
    if isinstance(skipped, torch.Tensor):  # fused: flags still on the device
        state.buffer_snapshot.restore_where(state.steps, skipped)
    elif skipped:
        state.buffer_snapshot.restore(state.steps)


def _contain_microbatch(state: StepState) -> None:
    if state.contain is None:
        state.contain = MicrobatchBuffer(state.params, state.accumulation_steps)
    dropped = state.contain.absorb(state.params)
    if state.micro_snapshot is not None:  # a dropped micro-batch's forward leaves no trace
        state.micro_snapshot.restore_where(_micro_key(state, state.micro - 1), dropped)


def _micro_key(state: StepState, micro: int) -> int:
    """A number unique to micro-batch ``micro`` of the window in progress."""
    return (state.steps + 1) * state.accumulation_steps + micro


def _grad_sync_context(state: StepState) -> contextlib.AbstractContextManager:
    final = state.micro >= state.accumulation_steps - 1
    if state.dist is not None:
        return state.dist.grad_sync_context(final, state.contain_microbatches)
    no_sync = getattr(state.model, "no_sync", None)
    if final or no_sync is None or not _is_ddp(state.model):
        return contextlib.nullcontext()
    return no_sync()


def _is_ddp(model: torch.nn.Module) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)
