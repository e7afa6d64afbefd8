# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG202 fires: optimizer.step() in the same step as scaler.step(optimizer)."""
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler()

for x in [torch.randn(2, 4)]:
    scaler.scale(model(x).sum()).backward()
    scaler.step(optimizer)
    optimizer.step()  # expect: AG202
    scaler.update()
    optimizer.zero_grad()


class Trainer:
    def __init__(self):
        self.model = torch.nn.Linear(4, 4)
        self.opt = torch.optim.Adam(self.model.parameters())
        self.scaler = torch.amp.GradScaler("cuda")

    def step(self, loss):
        self.scaler.scale(loss).backward()
        self.opt.step()
        self.scaler.step(self.opt)  # expect: AG202
        self.scaler.update()


def train_one_epoch(model, criterion, optimizer, loader, args, scaler=None):
    for image, target in loader:
        output = model(image)
        optimizer.zero_grad()
        if args.amp:
            with torch.autocast("cuda"):
                loss = criterion(output, target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss = criterion(output, target)
            loss.backward()
        optimizer.step()  # expect: AG202


def deferred_step(model, loader, use_amp):
    # the previous batch's step at the top of the loop, and a plain step left at the bottom
    for i, x in enumerate(loader):
        if use_amp and i > 0:
            scaler.step(optimizer)  # expect: AG202
            scaler.update()
        scaler.scale(model(x).sum()).backward()
        optimizer.step()
