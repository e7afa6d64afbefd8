# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG205 look-alike: a weights-only export keeps the checkpoint layout with ``"optimizer": None``
(and an optimizer state only when asked for); no optimizer state, so no scaler state is missing."""
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")


def train(loader):
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def export(path, epoch):
    torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": None, "ema": None}, path)


def strip_optimizer(ckpt_path, out_path):
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    ckpt = {"model": ckpt["model"], "optimizer": None, "updates": None}
    torch.save(ckpt, out_path)
