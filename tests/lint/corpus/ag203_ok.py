# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG203 look-alikes: gated scaler, bf16 without a scaler, exclusive branches, disabled scaler."""
import torch

model = torch.nn.Linear(4, 4)
dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
ptdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = torch.amp.autocast(device_type="cuda", dtype=ptdtype)
scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))


def bf16_only(x):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(x).sum()


def branches(x, bf16):
    if bf16:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).sum()
        loss.backward()
    else:
        s = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).sum()
        s.scale(loss).backward()


def disabled(x):
    s = torch.amp.GradScaler("cuda", enabled=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).sum()
    s.scale(loss).backward()


def conditional_scaler(x, fp16):
    s = torch.amp.GradScaler("cuda") if fp16 else None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).sum()
    return s, loss
