"""`python -m hpsearch.bench`: the project's own speed, as ratios measured interleaved in one run (issue 12).

    python -m hpsearch.bench [--shape t5-small] [--tasks 8] [--reps 7] [--threads N] [--batch 32x64+8]
                             [--methods ROW ...] [--batching task|mixed]
                             [--host-allocator reuse|system] [--checkpoint-shape t5-base]
                             [--memory-shape t5-large] [--memory-world 2]
                             [--only GROUP ...] [--skip GROUP ...] [--json]

Groups (all by default; `--only` / `--skip` select):
    step        train step (fwd, bwd, AdamW) of every method in the registry ÷ MTL, and MTL ÷ stock T5
    generate    greedy generation with frozen prompts ÷ MTL (and prompts generated per call, for contrast)
    flops       achieved model FLOP/s of the stock and HyperPrompt-Global steps ÷ this machine's fp32 matmul peak
                (the fastest of square matmuls 1024² to 4096²)
    deepspeed   one in-process DeepSpeed rank (recipe's config; ZeRO-3 and ZeRO-0) ÷ a plain torch loop
    checkpoint  bytes a `--local` run writes per evaluation, and what the best weights and checkpoints keep
                (`--checkpoint-shape`, default t5-base: about 35 s here)
    trial       fixed cost of a trial: `python -m hpsearch.train` at two step counts, with Ray and --local
                (subprocesses, a few minutes even at t5-tiny: `--skip trial` for a quick look)
    study       fixed cost of a trial inside a study (`python -m hpsearch.tune`): studies of 1 and 3 trials, one-
                worker trials in their own Tune actor and two-worker trials on the ranks it keeps, and for contrast
                the same trials each launching Ray Train's worker group
    memory      peak host memory of `--memory-world` (2) ZeRO-3 ranks building (the recipe's zero.Init build, and
                the whole model on every rank for contrast), initialising DeepSpeed and exporting `--memory-shape`
                (default t5-large: ~15 GB of RAM at its peak, a few minutes)

`--methods` picks the method rows of `step`, `generate` and `flops` (MTL and stock T5 always run); `--batch` sets
the batch of those and of `deepspeed`. `step`, `generate` and `flops` share one interleaved pool (one warm-up
round, then `--reps` rounds); `deepspeed` has its own. Figures are ratios of minimum times; each is printed beside
its goal, `--json` adds one JSON object on the last line. Nothing runs on a GPU: this measures the code's overheads
on this machine's CPU.
"""
GROUPS = ("step", "generate", "flops", "deepspeed", "checkpoint", "trial", "study", "memory")
