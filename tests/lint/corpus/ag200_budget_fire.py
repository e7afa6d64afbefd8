# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""The path budget is exceeded: a CLIP-style fine-tune with one optimizer per tower, each stepped
under its own config flag, gives more combinations than the interpreter keeps apart. The unit is
not guessed at: an AG200 note (info) names the function and its line."""
import torch


def finetune(cfg, model, loader, opt, opt_visual, opt_text, opt_proj, opt_prompt, opt_logit):  # expect: AG200
    scaler = torch.amp.GradScaler("cuda")
    for images, texts in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(images, texts)
        scaler.scale(loss).backward()
        scaler.step(opt)
        if cfg.train_visual:
            scaler.step(opt_visual)
        if cfg.train_text:
            scaler.step(opt_text)
        if cfg.train_proj:
            scaler.step(opt_proj)
        if cfg.train_prompt:
            scaler.step(opt_prompt)
        if cfg.train_logit_scale:
            scaler.step(opt_logit)
        scaler.update()
        model.zero_grad(set_to_none=True)
