# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Step helpers in a sibling file, guarded by their own `if scaler is not None:`."""


def backward(loss, scaler=None):
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def optimizer_step(optimizer, scaler=None):
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
