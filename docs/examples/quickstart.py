import torch

import ampguard as ag

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(256, 32), torch.randn(256, 1)

# autocast, scaled backward, unscale, clip, step and scale update, in the right order
with ag.Guard(model, optimizer, precision="fp16", clip_grad_norm=1.0,
              telemetry="ampguard-runs/quickstart") as guard:
    for step in range(50):
        with guard.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        result = guard.step()  # an ag.StepResult: applied or skipped, and why
print(f"{guard.skipped_steps} of {guard.steps} steps skipped, loss scale {guard.scale:g}")
print(guard.findings())  # AG codes with their fixes (also in findings.json)
# leaving the block wrote ampguard-runs/quickstart/report.html
