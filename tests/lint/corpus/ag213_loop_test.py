# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG213 stays silent in test files (``*_test.py``, ``test_*.py``): a test reads the loss each step
on purpose."""
import torch


def check_loss_goes_down(model, optimizer, loader):
    scaler = torch.amp.GradScaler("cuda")
    losses = []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        print(f"loss {loss.item():.4f}")
        losses.append(loss.item())
    assert losses[-1] < losses[0]
