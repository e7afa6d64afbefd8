# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG214 look-alikes: backward after the with block, a gradient penalty inside autocast, a disabled
region, a backward in a function defined inside the region."""
import torch
import torch.nn.functional as F

model = torch.nn.Linear(4, 4)
critic = torch.nn.Linear(4, 1)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")


def train(loader):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def gradient_penalty(real):
    # The penalty's own graph is built under autocast, as in PyTorch's AMP gradient-penalty
    # example: autograd.grad(create_graph=True) here is part of the forward pass of the loss.
    real.requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.float16):
        out = critic(real)
        grads = torch.autograd.grad(outputs=scaler.scale(out.sum()), inputs=real,
                                    create_graph=True)[0]
        penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
    scaler.scale(penalty).backward()


def train_fp32_debug(loader):
    for x, y in loader:
        with torch.autocast("cuda", enabled=False):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        optimizer.step()


def closure_inside(x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)

        def closure():
            optimizer.zero_grad()
            loss.backward()
            return loss

    return closure
