# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""An LLM fine-tune that saves through the project's saver, which builds the dict without the
GradScaler: one finding (project mode) listing both save lines."""
import torch

from model_utils import export_weights, save_checkpoint


def finetune(model, optimizer, loader, lr, out_dir, eval_fn):
    scaler = torch.amp.GradScaler("cuda")
    best = float("inf")
    for it, batch in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if it % 1000 == 0:
            save_checkpoint(model, optimizer, lr, it, f"{out_dir}/last.pt")  # expect: AG205
            val = eval_fn(model)
            if val < best:
                best = val
                save_checkpoint(model, optimizer, lr, it, f"{out_dir}/best.pt")
    export_weights(model, f"{out_dir}/final.pt")
