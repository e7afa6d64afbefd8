# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""A nanoGPT-style script: correct loop, but the two issues research found in the real one."""
import os
from contextlib import nullcontext

import torch

out_dir = "out"
gradient_accumulation_steps = 5
grad_clip = 1.0
max_iters = 100
log_interval = 1
device = "cuda"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

model = torch.nn.Linear(8, 8)
raw_model = model
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))  # expect: AG206


def get_batch(split):
    return torch.randn(4, 8), torch.randn(4, 8)


X, Y = get_batch("train")
iter_num = 0
best_val_loss = 1e9
while True:
    if iter_num % 100 == 0 and iter_num > 0:
        checkpoint = {
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
        }
        torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))  # expect: AG205
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits = model(X)
            loss = torch.nn.functional.mse_loss(logits, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}")
    iter_num += 1
    if iter_num > max_iters:
        break
