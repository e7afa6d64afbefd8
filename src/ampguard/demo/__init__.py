"""``ampguard demo``: train a small model in fp16 on CPU through a Guard and report what happened.

The built-in data carry a short burst of outlier batches that overflow fp16; the Guard skips those
steps, backs the loss scale off and grows it back, and the LR schedule only advances on applied
steps. Forensics replays an overflowing step in fp16 and fp32 and names the module.
"""

from ampguard.demo._run import DemoResult, build_model, run_demo

__all__ = ["run_demo", "DemoResult", "build_model"]
