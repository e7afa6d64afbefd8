"""The catalogue of finding codes: every code ampguard can emit, in one place.

Each :class:`Code` holds the stable code, the default severity, the one-line title, the area that
emits it, what fires it, the fix and the docs page that explains it. :class:`ampguard.Finding`
refuses a code that is not listed here, the findings page of the docs is generated from this
table, and a test checks the README's and the docs' code tables against it. Imports no torch.

The first digit of a code is its family (:data:`FAMILIES`: runtime, lint, the model-level
tools); the findings page states the families from that table, and nothing else lists codes or
ranges of codes by hand: a list of codes is read from here (by area or family).

Every emitter takes the title and the severity from here (``ampguard.findings.make``, the lint
rules' ``Rule.from_code``). Where a finding carries detail in its title (the module, the op, which
way a flag disagrees) the title *starts* with the catalogue's and the detail follows a colon or a
parenthesis. Where the severity legitimately varies the catalogue holds the default and the
emitter passes the actual one: AG101 (error at ``min_scale``, warning otherwise), AG103 (info for
a run too short to judge its skip rate), AG109 (error once the Guard stops on consecutive
skips), AG301 (warning for a confirmed burst that did not recur), AG321 (warning when the probe
saw activations round to 1 in fp16).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["AREAS", "CATALOGUE", "EXAMPLES", "FAMILIES", "Code", "family", "lookup"]

AREAS = {
    "runtime": "telemetry.md",
    "attach": "integrations.md",
    "distributed": "distributed.md",
    "step": "guarded-step.md",
    "spikes": "spikes.md",
    "fp8": "fp8.md",
    "lint": "lint.md",
    "forensics": "forensics.md",
    "triage": "triage.md",
    "coverage": "coverage.md",
    "advisor": "compare.md",
    "compare": "compare.md",
}


FAMILIES = {
    "AG1": "runtime (rules over the run log, attach mode, distributed, fp8 telemetry)",
    "AG2": "lint",
    "AG3": "forensics, coverage, advisor, compare and the fp8 plan",
}
"""A code's family, by its first digit (``AG1xx`` runtime, ...): what the findings page says."""


@dataclass(frozen=True)
class Code:
    """One finding code: what it means, when it fires and what to do about it."""

    code: str
    severity: str
    title: str
    area: str
    fires: str
    fix: str
    example: str = ""  # lint codes: a snippet that fires the code (tests/test_docs.py checks it)

    @property
    def doc(self) -> str:
        """The docs page (relative to ``docs/``) that explains the feature emitting the code."""
        return AREAS[self.area]


def _table(*rows: tuple[str, str, str, str, str, str]) -> dict[str, Code]:
    return {row[0]: Code(*row) for row in rows}


CATALOGUE: dict[str, Code] = _table(
    # -- runtime: rules over the run log (telemetry) ------------------------------------------
    (
        "AG101",
        "error",
        "loss scale collapse",
        "runtime",
        "a step overflowed at min_scale (error); an overflow left the scale within "
        "collapse_floor_factor of min_scale, or after warm-up it fell by 2**collapse_halvings "
        "within collapse_window steps (warning)",
        "run ag.locate on an overflowing batch; keep the named module in fp32, or use bf16",
    ),
    (
        "AG102",
        "warning",
        "loss scale oscillation",
        "runtime",
        "at least osc_min_cycles grow -> overflow -> back-off cycles after warm-up",
        "a longer growth_interval, hysteresis=2, or a max_scale just below the level that "
        "overflows",
    ),
    (
        "AG103",
        "warning",
        "high skipped-step rate",
        "runtime",
        "after warm-up more than skip_rate of the steps of some skip_window-step window were "
        "skipped (warning); a run with fewer than skip_min_steps steps after warm-up gets an "
        "info-level summary of its skips by cause when more than skip_rate of its steps were "
        "skipped for causes other than warm-up probing, or more than half of them in all",
        "find the overflowing module (AG101/AG301) or lower max_scale",
    ),
    (
        "AG104",
        "warning",
        "dead layer",
        "runtime",
        "a layer's gradient was exactly zero on dead_steps consecutive sampled applied steps "
        "while another layer's was not",
        "check for underflow (AG106) at the scale in use, a detached branch or a frozen layer",
    ),
    (
        "AG105",
        "warning",
        "fp16 saturation",
        "runtime",
        "a layer's largest unscaled gradient came within saturation_factor of 65504",
        "clip gradients, keep the layer in fp32, or use bf16",
    ),
    (
        "AG106",
        "warning",
        "gradient underflow",
        "runtime",
        "more than underflow_frac of a layer's nonzero gradients fell below fp16's smallest "
        "normal at the scale in use, on at least half of its range samples",
        "raise init_scale/max_scale into the layer's safe window, or use bf16",
    ),
    (
        "AG107",
        "warning",
        "loss scale gap after resume",
        "runtime",
        "the resumed scale differs from the one before the interruption by 2**resume_gap_bits or "
        "more, or was reset to init_scale",
        "save the Guard's state in checkpoints (ag.save_checkpoint(..., guard=guard)); "
        "ResumeWarmup ramps the LR while the scale finds its level",
    ),
    (
        "AG108",
        "warning",
        "bf16 recommended",
        "runtime",
        "on bf16_min_samples range samples no fp16 scale held both the small and the large "
        "gradients",
        "train in bf16 where the device supports it",
    ),
    (
        "AG109",
        "warning",
        "non-finite gradients skipped",
        "step",
        "bf16/fp32 windows whose gradients were non-finite were skipped by the Guard; an error "
        "once "
        "ScalerConfig.max_nonfinite_skips of them came in a row",
        "find the source with ag.locate (data, loss or a diverging model); lower the LR or clip",
    ),
    (
        "AG110",
        "error",
        "non-finite gradients applied",
        "attach",
        "a watched loop without a loss scaler applied an optimizer step on non-finite gradients",
        "train with ag.Guard (it skips non-finite steps in every precision) or skip such steps",
    ),
    (
        "AG111",
        "warning",
        "a layer's input or weight leaves the e4m3 window",
        "fp8",
        "during fp8 training, on at least half of a converted layer's samples more than the plan's "
        "limit of its input's or weight's nonzero values flushed to zero in e4m3",
        "keep the layer in bf16 (ag.fp8_plan + fp8_plan=) or use the rowwise recipe",
    ),
    (
        "AG112",
        "warning",
        "a layer's output gradient underflows fp8",
        "fp8",
        "during fp8 training, on at least half of a converted layer's samples more than the plan's "
        "limit of its output gradient's nonzero values flushed to zero",
        "keep the layer in bf16 (ag.fp8_plan + fp8_plan=)",
    ),
    (
        "AG113",
        "warning",
        "an fp8 layer moved back to bf16 during training",
        "fp8",
        "under Guard(precision='fp8', auto_fallback=True) a converted layer's input, weight or "
        "output gradient flushed more than the plan's limit to zero on 2 samples in a row, so "
        "the Guard turned it back into a bf16 nn.Linear",
        "keep the layer in bf16 from the start: ag.fp8_plan on a batch from that point of "
        "training, then fp8_plan=",
    ),
    (
        "AG114",
        "warning",
        "a layer moved one format up during training",
        "fp8",
        "under Guard(precision=<a {layer: format} recipe or ag.RecipeCertificate>) the "
        "gradient-fidelity meter, re-read every recheck_every steps on the step's batch, found "
        "a layer's weight gradient (or forward input) outside its limits against bf16 on 2 "
        "re-checks in a row, so the Guard moved the layer to the next format up (bf16 last); "
        "it stays there (no move back down), and checkpoints keep the move and a pending count",
        "start the layer in that format: ag.recipe_search on batches from this point of training",
    ),
    # -- runtime: silent precision failures ---------------------------------------------------
    (
        "AG170",
        "warning",
        "fp16 overflow absorbed inside a module",
        "runtime",
        "on range-sampling steps, fp16 intermediates inside a module overflowed to inf while "
        "the module's output stayed finite (a hand-written norm: (x - u).pow(2) -> inf, then "
        "/ sqrt(inf) = 0)",
        "keep the module in fp32 (keep_fp32=[...] or auto_fallback=True), use bf16, or "
        "normalise before squaring",
    ),
    (
        "AG171",
        "warning",
        "fp16 without a loss scaler loses gradient",
        "runtime",
        "an fp16 run without a loss scaler: on range samples a layer's nonzero gradients fell "
        "below fp16's smallest normal (subnormal or flushed to zero)",
        "use a loss scaler (Guard(precision='fp16') / torch.amp.GradScaler) or bf16",
    ),
    # -- attach mode (ag.watch and the framework integrations) --------------------------------
    (
        "AG120",
        "warning",
        "skipped-step flag disagrees with the scaler",
        "attach",
        "the framework reported skipped steps as applied (or the reverse), e.g. Accelerate or the "
        "HF Trainer with a fused optimizer, so its LR scheduler advanced on skipped steps",
        "step the scheduler only on applied steps, or use a non-fused optimizer with the framework",
    ),
    (
        "AG121",
        "info",
        "attach-mode guard changed the loss scale",
        "attach",
        "attach-mode min_scale / max_scale / hysteresis changed the scale",
        "none needed: the counts show how often the guard acted",
    ),
    (
        "AG122",
        "warning",
        "fp16 requested but not active",
        "attach",
        "fp16 was requested but the framework runs without a loss scaler and fp16 autocast "
        "on this device (it trains in fp32 or switched to bf16)",
        "ask for the precision the device supports, or run on a device with fp16",
    ),
    # -- runtime: the run log's own disk ------------------------------------------------------
    (
        "AG140",
        "warning",
        "steps not recorded",
        "runtime",
        "a write to the run folder failed (a full or read-only disk) and telemetry, suspended, "
        "could not record a range of steps (the log's `unrecorded` line or meta.json says which)",
        "give the run folder a disk with room; Telemetry(on_write_error='raise') stops the run "
        "instead of leaving a gap",
    ),
    # -- distributed ----------------------------------------------------------------------------
    (
        "AG130",
        "error",
        "ranks out of sync",
        "distributed",
        "the cross-rank audit found ranks whose scale, trackers, counters, precision or "
        "parameter checksum differ",
        "on_desync='repair' copies rank 0's state; find why the ranks diverged (rank-local code "
        "paths, non-deterministic data)",
    ),
    (
        "AG131",
        "warning",
        "overflows start on some ranks only",
        "distributed",
        "per-rank counts of non-finite local gradients are far apart",
        "inspect the data shard and the hardware of the named ranks",
    ),
    (
        "AG132",
        "warning",
        "non-finite gradients on some ranks",
        "distributed",
        "the non-finite-safe DDP hook saw non-finite local gradients on the named ranks",
        "inspect the named ranks' data; the hook kept the step by dropping them",
    ),
    # -- lint -------------------------------------------------------------------------------------
    (
        "AG200",
        "error",
        "file could not be parsed",
        "lint",
        "a file that does not parse, is not UTF-8 (or its declared encoding), or cannot be read; "
        "as a note (info): a function over the lint path budget, not checked by the order rules",
        "fix the syntax or the encoding",
    ),
    (
        "AG201",
        "error",
        "gradient clipping on scaled gradients",
        "lint",
        "clip_grad_norm_/clip_grad_value_ after scaler.scale(loss).backward() with no "
        "scaler.unscale_(opt) before it in the step",
        "call scaler.unscale_(optimizer) right before clipping",
    ),
    (
        "AG202",
        "error",
        "optimizer stepped twice",
        "lint",
        "optimizer.step() in the same step as scaler.step(optimizer)",
        "call only scaler.step(optimizer)",
    ),
    (
        "AG203",
        "warning",
        "GradScaler used with bfloat16",
        "lint",
        "an enabled GradScaler with bf16 autocast (or precision='bf16-mixed', bf16=True) in the "
        "same scope",
        "drop the scaler for bf16, or GradScaler(enabled=(dtype == torch.float16))",
    ),
    (
        "AG204",
        "error",
        "scaler.update() missing or mistimed",
        "lint",
        "scaler.step() repeated in a loop with no scaler.update() in between; update() on every "
        "micro-batch of gradient accumulation",
        "one update() right after each scaler.step()",
    ),
    (
        "AG205",
        "warning",
        "checkpoint without GradScaler state",
        "lint",
        "torch.save of a dict with model and optimizer state but no scaler.state_dict(), in a file "
        "that uses a GradScaler",
        "add 'scaler': scaler.state_dict() and load it on resume",
    ),
    (
        "AG206",
        "warning",
        "deprecated AMP API",
        "lint",
        "torch.cuda.amp.autocast/GradScaler/custom_fwd/custom_bwd, torch.cpu.amp.* (info as a "
        "fallback for old torch)",
        "torch.amp.autocast('cuda', ...), torch.amp.GradScaler('cuda'), torch.amp.custom_fwd",
    ),
    (
        "AG207",
        "warning",
        "LR scheduler steps on skipped optimizer steps",
        "lint",
        "scheduler.step() right after scaler.step(...), unconditionally or under an if that does "
        "not test whether the step ran",
        "step the scheduler only when the optimizer stepped (StepResult.applied)",
    ),
    (
        "AG208",
        "warning",
        "unsafe checkpoint load",
        "lint",
        "torch.load(..., weights_only=False), or no weights_only on torch < 2.6",
        "weights_only=True (+ add_safe_globals) or ag.load_checkpoint",
    ),
    (
        "AG209",
        "warning",
        "log of softmax (numerically fragile loss)",
        "lint",
        "torch.log(torch.softmax(x)), x.softmax(-1).log(), log(nn.Softmax(dim)(x))",
        "log_softmax, cross_entropy",
    ),
    (
        "AG210",
        "error",
        "binary_cross_entropy / BCELoss inside autocast",
        "lint",
        "binary_cross_entropy / nn.BCELoss inside a (non-CPU) autocast region",
        "binary_cross_entropy_with_logits / BCEWithLogitsLoss on the logits",
    ),
    (
        "AG211",
        "error",
        "model cast to fp16 while a GradScaler is used",
        "lint",
        "model.half() / .to(torch.float16) at module level or in the function that uses a "
        "GradScaler",
        "keep fp32 parameters; autocast runs the ops in fp16",
    ),
    (
        "AG212",
        "warning",
        "GradScaler in no-grad or evaluation code",
        "lint",
        "GradScaler(...) or scaler.scale(...) under no_grad/inference_mode or in evaluation code",
        "use the scaler only in the training step",
    ),
    (
        "AG213",
        "info",
        "per-step host sync only for logging",
        "lint",
        "a per-step loss.item() / .cpu() / float(t) / formatted device tensor / "
        "scaler.get_scale() whose value is only logged",
        "log every N steps, or accumulate on the device",
    ),
    (
        "AG214",
        "warning",
        "backward inside autocast",
        "lint",
        "loss.backward(), scaler.scale(loss).backward(), accelerator.backward or autograd.grad "
        "without create_graph inside an autocast region",
        "dedent the backward call out of the with-autocast block: backward ops run in the dtype "
        "their forward chose",
    ),
    # -- the guarded step: update stagnation, restored buffers ---------------------------------
    (
        "AG175",
        "warning",
        "update stagnation (low-precision weights)",
        "step",
        "on sampled steps at least half of a bf16/fp16 layer's intended updates (elements with a "
        "nonzero gradient) left the stored weight unchanged: they were below half an ulp",
        "fp32 master weights (model in float32, autocast for the math), or Kahan summation / "
        "stochastic rounding on the layers that need it (Guard(..., stagnation_rescue='auto'); "
        "torchao.optim.AdamW(..., bf16_stochastic_round=True) for AdamW)",
    ),
    (
        "AG176",
        "warning",
        "optimizer states in low precision",
        "step",
        "an optimizer keeps tensor states (exp_avg, exp_avg_sq, ...) of bf16/fp16 parameters in "
        "bf16/fp16: their running averages round away like the weights' updates",
        "Guard(..., fp32_optimizer_states=True) keeps them in fp32",
    ),
    (
        "AG177",
        "info",
        "stagnation rescue in use",
        "step",
        "Guard(stagnation_rescue=...) writes the fp32 update of these layers back through Kahan "
        "compensation or stochastic rounding; the lost share before and the applied share after",
        "nothing to fix: the rescue is working; compare the applied share with 100%",
    ),
    # -- the guarded step: loss spikes (the flight recorder) -----------------------------------
    (
        "AG180",
        "warning",
        "loss spike",
        "spikes",
        "a window's loss rose above the flight recorder's bound: the running mean of the "
        "log-loss plus max(6 spreads, log 1.3), after a 50-window warm-up; the evidence gives the "
        "loss, the bound, the ratio to the running level and what on_spike did",
        "ampguard.autopsy(guard) replays the spike and names the layer and the mechanism; "
        "on_spike='skip' or 'rewind' keeps such a step out of the weights",
    ),
    # -- forensics ------------------------------------------------------------------------------
    (
        "AG300",
        "info",
        "no non-finite value",
        "forensics",
        "ag.locate found the loss and the gradients finite and nothing flushed to zero",
        "none",
    ),
    (
        "AG301",
        "error",
        "fp16 overflow",
        "forensics",
        "a value is non-finite only in fp16: beyond 65504 in forward, or a gradient even at scale "
        "1",
        "keep the named module in fp32 (keep_fp32=[...]) or use bf16",
    ),
    (
        "AG302",
        "warning",
        "fp16 underflow",
        "forensics",
        "a layer's gradients are all zero in fp16 but not in fp32, or more than 10% of its "
        "nonzero fp32 gradient elements are flushed to zero or left as subnormals with <= 4 "
        "significant bits at the loss scale of the run",
        "a larger loss scale (a loss scaler, if the loop has none), or bf16",
    ),
    (
        "AG303",
        "error",
        "non-finite in fp32 too (not an AMP problem)",
        "forensics",
        "fp32 goes non-finite as well (log of a negative, NaN weights): not an AMP problem",
        "fix the model or the learning rate",
    ),
    (
        "AG304",
        "error",
        "the batch holds NaN/inf",
        "forensics",
        "the batch holds NaN or inf; the module named is the first that consumed it",
        "filter or repair the data",
    ),
    (
        "AG305",
        "info",
        "loss-scale probe overflow (benign)",
        "forensics",
        "a backward overflow that is gone at loss scale 1: the scaler probing its level",
        "none: the scaler backs off by design",
    ),
    (
        "AG306",
        "info",
        "auto_fallback kept a module in fp32",
        "forensics",
        "auto_fallback kept a module that overflowed fp16 in fp32",
        "add the module to keep_fp32=[...] for the next run",
    ),
    (
        "AG365",
        "warning",
        "precision stagnation in the optimizer step",
        "forensics",
        "ag.locate(..., optimizer=opt): one optimizer step on the batch left at least half of a "
        "bf16/fp16 layer's intended updates rounded away; with ema=..., the same for one lerp_ "
        "update of an EMA/teacher the optimizer does not own",
        "fp32 master weights, or stochastic rounding / Kahan summation (torchao's "
        "bf16_stochastic_round)",
    ),
    (
        "AG366",
        "error",
        "optimizer eps underflows the weights' dtype",
        "forensics",
        "an optimizer's eps rounds to 0 in the dtype of fp16/bf16 weights (Adam's 1e-8 in fp16), "
        "so m / (sqrt(v) + eps) divides by zero and writes inf/NaN into the weights",
        "fp32 master weights (no .half()); or an eps the dtype holds (>= 1e-4 in fp16)",
    ),
    (
        "AG367",
        "warning",
        "loss plateau above fp32 (silent stall)",
        "compare",
        "ag.compare: the low-precision variant stayed finite but its loss at the same applied "
        "steps ended far above fp32's",
        "read the per-layer evidence named in the verdict: ag.locate(..., optimizer=opt) and the "
        "Guard's AG175 / AG106 findings",
    ),
    # -- triage: hardware or math, by deterministic replay ---------------------------------------
    (
        "AG380",
        "warning",
        "failed step is numerics (low precision)",
        "triage",
        "ag.triage: the failed step replays bit for bit at its precision, every module agrees "
        "with a CPU reference, and the step does not fail in fp32",
        "follow the attached ag.locate diagnosis (keep the named module in fp32, bf16, or "
        "rescale before the op that leaves the range)",
    ),
    (
        "AG381",
        "error",
        "failed step is the model or the data",
        "triage",
        "ag.triage: the failed step replays bit for bit, every module agrees with a CPU "
        "reference, and it fails in fp32 too",
        "inspect the batch and the named module (a NaN input, log(0), a division by zero, an "
        "exploding learning rate): it is not a precision or hardware problem",
    ),
    (
        "AG382",
        "error",
        "transient hardware fault",
        "triage",
        "ag.triage: a replay of the failed step on the same rank, precision, state and batch "
        "does not reproduce its recorded signatures: the first run computed something else",
        "skip the step or rewind to the last snapshot and carry on; watch the named rank for "
        "recurrences (several in a few days: have the device tested)",
    ),
    (
        "AG383",
        "error",
        "persistent hardware fault",
        "triage",
        "ag.triage: the failed step reproduces, and the named module computes a wrong value "
        "from right inputs on this rank every time (a CPU reference or a peer disagrees)",
        "take the named rank's device out of the job (drain the node, run the vendor's "
        "diagnostics) and resume from the last checkpoint written before the first fault",
    ),
    # -- autocast coverage ----------------------------------------------------------------------
    (
        "AG310",
        "warning",
        "module escaped autocast",
        "coverage",
        "all of a module's matmul-family ops ran in fp32 under autocast",
        "remove the autocast(enabled=False) / .float() island, or add custom_fwd/custom_bwd",
    ),
    (
        "AG311",
        "warning",
        "fragile op in half precision",
        "coverage",
        "exp/log/pow, softmax or a large reduction ran in fp16/bf16 in the forward pass",
        "compute it in fp32 (autocast does for most of these: check for a manual .half())",
    ),
    # -- advisor and compare --------------------------------------------------------------------
    (
        "AG320",
        "info",
        "BatchNorm-heavy model",
        "advisor",
        "many BatchNorm layers: one overflowing batch poisons their running statistics",
        "keep BatchNorm in fp32 or use bf16",
    ),
    (
        "AG321",
        "info",
        "saturating activations",
        "advisor",
        "tanh/sigmoid-like activations; a warning when outputs round to +-1 only in fp16",
        "keep the activation's module in fp32 or use bf16",
    ),
    (
        "AG322",
        "warning",
        "custom autograd.Function without custom_fwd/custom_bwd",
        "advisor",
        "a custom autograd.Function runs under autocast without torch.amp.custom_fwd/custom_bwd",
        "decorate forward/backward with torch.amp.custom_fwd/custom_bwd",
    ),
    (
        "AG323",
        "error",
        "optimizer trains fp16 parameters",
        "advisor",
        "the optimizer holds fp16 parameters (GradScaler refuses them)",
        "keep fp32 master weights; autocast casts the ops",
    ),
    (
        "AG324",
        "error",
        "optimizer eps rounds to zero in half precision",
        "advisor",
        "an Adam-style eps that is zero in the parameters' half precision",
        "keep fp32 parameters or raise eps",
    ),
    (
        "AG325",
        "warning",
        "modules already cast to half precision",
        "advisor",
        "modules cast with .half() / .to(torch.bfloat16)",
        "keep fp32 parameters and use autocast",
    ),
    (
        "AG326",
        "error",
        "fp16 forward overflow predicted",
        "advisor",
        "a module's output passes 65504 in the fp32 probe",
        "keep the named modules in fp32 (keep_fp32=[...]) or use bf16",
    ),
    (
        "AG327",
        "warning",
        "activations close to fp16's max",
        "advisor",
        "activations within 8x of 65504",
        "watch the module; keep it in fp32 if it grows",
    ),
    (
        "AG328",
        "error",
        "gradients overflow fp16 even at loss scale 1",
        "advisor",
        "gradients past 65504 even at loss scale 1: no scale helps",
        "bf16, or keep the producing module in fp32",
    ),
    (
        "AG329",
        "warning",
        "gradients flushed to zero in fp16",
        "advisor",
        "gradients flushed to zero at the largest scale that keeps the loudest module finite",
        "bf16, or keep the loud module in fp32 so the scale can rise",
    ),
    (
        "AG330",
        "warning",
        "activations flushed to zero in fp16",
        "advisor",
        "activations below 2**-25 become zero in fp16",
        "rescale the inputs or use bf16",
    ),
    (
        "AG331",
        "info",
        "precision plan",
        "advisor",
        "the advisor's recommendation: bf16, or fp16 with a keep_fp32 list and an init_scale hint",
        "the ag.Guard(...) line in the finding's fix",
    ),
    (
        "AG332",
        "error",
        "non-finite values already in fp32",
        "advisor",
        "the fp32 probe itself is non-finite: not an AMP problem",
        "fix the model or the data",
    ),
    (
        "AG333",
        "info",
        "AMP trains like fp32",
        "compare",
        "fp16 with dynamic scaling trains like fp32",
        "none",
    ),
    (
        "AG334",
        "warning",
        "dynamic loss scaling fails where a fixed small scale trains",
        "compare",
        "dynamic scaling fails while a fixed scale trains",
        "ScalerConfig(init_scale=64, max_scale=64) or a longer growth_interval",
    ),
    (
        "AG335",
        "error",
        "values leave fp16's range at any loss scale",
        "compare",
        "the fixed scale fails too while fp32 trains",
        "bf16, or keep_fp32=[...] for the module ag.locate names",
    ),
    (
        "AG336",
        "error",
        "fp32 fails too: not an AMP problem",
        "compare",
        "fp32 is non-finite too or its final loss is 100x the first",
        "fix the LR, data or init",
    ),
    (
        "AG337",
        "info",
        "fp8 trains like bf16",
        "compare",
        "the fp8 variant's final loss is close to bf16's",
        "none",
    ),
    (
        "AG338",
        "warning",
        "fp8 trains like bf16 only with some layers kept in bf16",
        "compare",
        "naive fp8 misses bf16's loss while fp8 with the plan's filter trains like bf16",
        "Guard(precision='fp8', fp8_plan=ag.fp8_plan(...)): the plan keeps the named layers in "
        "bf16",
    ),
    (
        "AG339",
        "error",
        "fp8 does not train like bf16",
        "compare",
        "neither naive nor planned fp8 trains like bf16",
        "train in bf16",
    ),
    (
        "AG340",
        "info",
        "layers ready for fp8",
        "fp8",
        "the fp8 plan found layers whose SQNR and flushed shares are within the thresholds",
        "ag.Guard(model, optimizer, precision='fp8', fp8_plan=plan)",
    ),
    (
        "AG341",
        "warning",
        "outlier features flush a layer's fp8 input",
        "fp8",
        "more than max_input_flushed of a layer's nonzero inputs become zero in e4m3 under the "
        "recipe's scaling (massive-activation channels set the amax)",
        "keep the layer in bf16, or the rowwise recipe",
    ),
    (
        "AG342",
        "warning",
        "a layer's output gradient flushes in fp8",
        "fp8",
        "more than max_grad_flushed of the layer's nonzero output gradients become zero",
        "keep the layer in bf16, or rescale the loss/gradients",
    ),
    (
        "AG343",
        "warning",
        "a layer's fp8 output is too noisy",
        "fp8",
        "the layer's output with fp8 inputs and weight has an SQNR below min_sqnr_db against bf16",
        "keep the layer in bf16, or the rowwise recipe",
    ),
    (
        "AG344",
        "warning",
        "a layer's weight flushes in e4m3",
        "fp8",
        "more than max_weight_flushed of the weight's nonzero values become zero in e4m3",
        "keep the layer in bf16, or rescale its initialisation",
    ),
    (
        "AG345",
        "info",
        "a layer shape fp8 matmuls do not accept",
        "fp8",
        "in or out features are not multiples of 16",
        "it stays in bf16 (nothing to do), or pad it",
    ),
    (
        "AG346",
        "info",
        "a Linear layer the traced forward never called",
        "fp8",
        "the plan's traced step never ran the layer, so it has no measurements",
        "plan with a batch that exercises the layer; it is kept in bf16 meanwhile",
    ),
    (
        "AG347",
        "info",
        "a layer the low-precision recipe keeps in higher precision",
        "fp8",
        "plan.recipe() keeps a Linear layer above the lowest measured format: a structural rule "
        "(first or last layer, a small layer) or a figure of the lower formats crossed its limit",
        "train the layer in the format the recipe names (plan.recipe()); the finding's message "
        "gives the figure that rules the lower formats out",
    ),
    (
        "AG348",
        "info",
        "a per-layer low-precision recipe",
        "fp8",
        "fp8_plan(..., formats=...) measured several formats: the recipe names each layer's format",
        "train each layer in its format: plan.recipe() maps module names to formats",
    ),
    # -- silent precision failures: locate and the advisor -------------------------------------
    (
        "AG360",
        "error",
        "fp16 overflow absorbed inside a module",
        "forensics",
        "ag.locate: an fp16 op in the forward made inf from finite inputs, a later op turned it "
        "back into finite values, the loss and gradients are finite and fp32 stays in range",
        "keep the named module in fp32 (keep_fp32=[...]), use bf16, or normalise before the "
        "op that overflows",
    ),
    (
        "AG361",
        "warning",
        "fp16 op inside a module overflows",
        "advisor",
        "ag.inspect_model: an fp16 op inside a module (an attention's q @ k.T before the "
        "1/sqrt(d) scale) leaves fp16's range on the probe batch while the module's output is "
        "in range",
        "scale before the matmul (q * d**-0.5 @ k.T), use F.scaled_dot_product_attention, keep "
        "the module in fp32, or use bf16",
    ),
    (
        "AG362",
        "warning",
        "sigmoid rounds to exactly 1.0 before a BCE loss",
        "advisor",
        "ag.inspect_model: a sigmoid's output feeds binary_cross_entropy and, in fp16, at least "
        "one probe sample's probability rounds to exactly 0 or 1 (a confidently wrong sample "
        "then costs log(0))",
        "return logits and use F.binary_cross_entropy_with_logits (BCEWithLogitsLoss)",
    ),
    (
        "AG363",
        "warning",
        "fp16 op in the loss code overflows or underflows",
        "advisor",
        "ag.inspect_model(model, batch, loss_fn): an fp16 op of the loss code, outside every "
        "module (torch.exp on the model's fp16 output), overflows or flushes its values to zero "
        "on the probe batch; named with its source line",
        "compute it in fp32 there (.float() first), or rescale before it (logsumexp); "
        "keep_fp32 cannot reach code outside every module",
    ),
    (
        "AG355",
        "warning",
        "matmul modules fp8 cannot convert",
        "fp8",
        "the model does matmuls in modules that are not nn.Linear (transformers Conv1D, "
        "nn.MultiheadAttention's in_proj_weight, nn.Bilinear, convolutions): precision='fp8' "
        "leaves them in bf16",
        "ag.conv1d_to_linear(model) for transformers Conv1D (exact); the others stay in bf16",
    ),
)

# A short script that fires each lint code (the findings page shows it; a test lints each).
EXAMPLES: dict[str, str] = {
    "AG200": ("import torch\ndef train(:\n    pass\n"),
    "AG201": (
        "import torch\n"
        "scaler.scale(loss).backward()\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # AG201: clips scaled gradients\n"
        "scaler.step(optimizer)\n"
        "scaler.update()\n"
    ),
    "AG202": (
        "import torch\n"
        "scaler.scale(loss).backward()\n"
        "scaler.step(optimizer)\n"
        "optimizer.step()  # AG202: a second update from the same gradients\n"
        "scaler.update()\n"
    ),
    "AG203": (
        "import torch\n"
        'scaler = torch.amp.GradScaler("cuda")\n'
        'with torch.autocast("cuda", dtype=torch.bfloat16):  # AG203: bf16 needs no scaler\n'
        "    loss = model(x).sum()\n"
        "scaler.scale(loss).backward()\n"
    ),
    "AG204": (
        "import torch\n"
        "for x in loader:\n"
        "    scaler.scale(model(x).sum()).backward()\n"
        "    scaler.step(optimizer)  # AG204: no scaler.update() in the loop\n"
    ),
    "AG205": (
        "import torch\n"
        'scaler = torch.amp.GradScaler("cuda")\n'
        'torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},\n'
        '           "ckpt.pt")  # AG205: the scaler\'s state is not saved\n'
    ),
    "AG206": (
        "import torch\n"
        'scaler = torch.cuda.amp.GradScaler()  # AG206: use torch.amp.GradScaler("cuda")\n'
    ),
    "AG207": (
        "import torch\n"
        "scaler.step(optimizer)\n"
        "scheduler.step()  # AG207: advances even when scaler.step skipped the update\n"
        "scaler.update()\n"
    ),
    "AG208": ('import torch\nstate = torch.load("ckpt.pt", weights_only=False)  # AG208\n'),
    "AG209": (
        "import torch\nlogp = torch.log(torch.softmax(logits, dim=-1))  # AG209: use log_softmax\n"
    ),
    "AG210": (
        "import torch\n"
        'with torch.autocast("cuda", dtype=torch.float16):\n'
        "    loss = torch.nn.functional.binary_cross_entropy(torch.sigmoid(z), y)  # AG210\n"
    ),
    "AG211": (
        "import torch\n"
        "model = Net().half()  # AG211: fp16 weights, a GradScaler cannot help\n"
        'scaler = torch.amp.GradScaler("cuda")\n'
    ),
    "AG212": (
        "import torch\n"
        "with torch.no_grad():\n"
        '    scaler = torch.amp.GradScaler("cuda")  # AG212: nothing to scale in evaluation\n'
    ),
    "AG213": (
        "import torch\n"
        "for x in loader:\n"
        "    loss = model(x).sum()\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(optimizer)\n"
        "    scaler.update()\n"
        "    print(loss.item())  # AG213: a host sync every step, only to log\n"
    ),
    "AG214": (
        "import torch\n"
        "for x, y in loader:\n"
        '    with torch.autocast("cuda", dtype=torch.float16):\n'
        "        loss = loss_fn(model(x), y)\n"
        "        scaler.scale(loss).backward()  # AG214: backward inside autocast\n"
        "    scaler.step(optimizer)\n"
        "    scaler.update()\n"
    ),
}
CATALOGUE.update({c: replace(CATALOGUE[c], example=text) for c, text in EXAMPLES.items()})


def family(code: str) -> str:
    """The family (a key of :data:`FAMILIES`, e.g. ``"AG1"``) of ``code``; ``KeyError`` names a
    code outside every family."""
    prefix = code[:3]
    if prefix not in FAMILIES:
        raise KeyError(f"finding code {code!r} is in no family of {sorted(FAMILIES)}")
    return prefix


def lookup(code: str) -> Code:
    """The catalogue entry of ``code``; ``KeyError`` names the code when it is not listed."""
    try:
        return CATALOGUE[code]
    except KeyError:
        raise KeyError(
            f"finding code {code!r} is not in ampguard's catalogue "
            "(ampguard.findings.codes.CATALOGUE)"
        ) from None
