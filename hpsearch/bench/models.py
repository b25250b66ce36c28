"""Groups `step`, `generate` and `flops`: every method of the registry against MTL, MTL against stock T5.

All models share one random backbone (copied, so every row starts from the same weights) and one batch, by
default 32 x (64 input + 8 target) tokens (`--batch`). A train step is forward, backward and AdamW; generation is
greedy with exactly as many new tokens as the targets (`min_new_tokens`: random weights would otherwise stop at
different lengths). Model FLOPs are counted once per model with `FlopCounterMode` on forward + backward; the
machine's peak is the fastest of three square fp32 matmuls (1024² to 4096²) timed in the same pool. A method row's
step goal is 1.03 x its FLOP ratio to MTL counted on models that hold only the batch's tasks (`needed_flops`): the
arithmetic the step needs, so work done for tasks the batch does not hold is not allowed for.
"""
from __future__ import annotations

import copy

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from hpsearch.bench.rows import BATCH, BatchShape, method_rows
from hpsearch.bench.timing import Figure, Pool, error_line, ratio

PEAK_SIZES = (1024, 2048, 4096)  # square fp32 matmuls; the fastest of them stands for the machine's peak
LR = 1e-4
STEP_GOAL, WRAPPER_GOAL, GENERATE_GOAL, MFU_GOAL = 1.03, 1.01, 1.01, 0.5
MFU_ROWS = ("stock", "hyperprompt-global")


def make_batch(vocab_size: int, n_tasks: int, batching: str, shape: BatchShape = BATCH) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab_size, (shape.rows, shape.source), generator=g)
    labels = torch.randint(2, vocab_size, (shape.rows, shape.target), generator=g)
    rows = shape.rows
    task_ids = torch.arange(rows) % n_tasks if batching == "mixed" else torch.zeros(rows, dtype=torch.long)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, task_ids=task_ids)


def build_row(shape: str, row: str, n_tasks: int, base):
    """The method model of `row` with `n_tasks` tasks on a copy of the backbone `base`."""
    from hpsearch.model import build_model

    method, hparams = next((m, h) for r, m, h in method_rows() if r == row)
    torch.manual_seed(0)
    return build_model(shape, method, [f"task{i}" for i in range(n_tasks)], t5=copy.deepcopy(base), **hparams)


def build_rows(shape: str, n_tasks: int, only: list[str] | None = None) -> tuple[dict, dict[str, str]]:
    """({row: model}, {row: error}) with row "stock" the plain T5ForConditionalGeneration; `only`: these method
    rows (with MTL, every ratio's denominator), else all."""
    from hpsearch.model.backbones import load_backbone

    torch.manual_seed(0)
    base = load_backbone(shape)
    models, errors = {"stock": copy.deepcopy(base)}, {}
    for row, _, _ in method_rows():
        if only and row not in only and row != "mtl":
            continue
        try:
            models[row] = build_row(shape, row, n_tasks, base)
        except Exception as e:  # a method that cannot be built at this shape is a row of the report, not a crash
            errors[f"build:{row}"] = error_line(e)
    return models, errors


def _inputs(row: str, batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "task_ids"} if row == "stock" else batch


def train_step(model, row: str, batch: dict):
    inputs = _inputs(row, batch)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, fused=True)  # as trained
    checked = []

    def step():
        model(**inputs).loss.backward()
        if not checked:  # the first call (the untimed warm-up): a row whose parameters the step does not train is
            idle = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]  # no figure
            if idle:
                raise RuntimeError(f"{row}: its step leaves {len(idle)} trained parameters without a gradient "
                                   f"({', '.join(idle[:3])})")
            checked.append(True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def generation(model, row: str, batch: dict):
    new = batch["labels"].shape[1]  # as many tokens as the batch's targets
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1)
    if row == "stock":
        return lambda: model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    return lambda: model.generate(batch["input_ids"], batch["attention_mask"], task_ids=batch["task_ids"], **kwargs)


def has_generators(model) -> bool:
    """True when the method makes its task tensors per call (so freezing them can save something)."""
    from hpsearch.model import MultiTaskT5

    return isinstance(model, MultiTaskT5) and type(model).fills_in("generate_task_tensors")


def _frozen(model):
    def setup():
        model.eval()
        if hasattr(model, "freeze_task_params"):  # stock T5 has nothing to freeze
            model.freeze_task_params()
            if has_generators(model) and not model.task_params_frozen:  # else "frozen" would time generation
                raise RuntimeError(f"{type(model).__name__}: freeze_task_params() left its task tensors unfrozen")
    return setup


def _dynamic(model):
    def setup():
        model.eval()
        if hasattr(model, "unfreeze_task_params"):
            model.unfreeze_task_params()
            if model.task_params_frozen:
                raise RuntimeError(f"{type(model).__name__}: unfreeze_task_params() left its task tensors frozen")
    return setup


# ---- memory ----------------------------------------------------------------------------------------------------
DEEPSPEED_COPIES = 10  # group deepspeed: a plain loop (3 W), ZeRO-0 (3 W) and ZeRO-3 (at least 4 W), with AdamW's state


def need_bytes(shape: str, groups: set[str], only: list[str] | None) -> tuple[int, int]:
    """(bytes, models): a lower bound of the host memory the in-process groups hold at once, from the bytes W of
    the shape's weights as MTL has them (stock T5's and the least of any row's; a build on the meta device).
    Groups step, generate and flops keep stock T5 and every method row alive together: 3 W each that steps
    (weights and AdamW's two moments), W each that only generates; group deepspeed (which runs after them, in the
    memory they gave back) about 10 W. Gradients, activations and the imports are not counted: at t5-small the
    measured resident memory of every row was 11.2 GiB against 8.1 GiB of this bound."""
    from hpsearch.bench.memory import weights_bytes

    weights = weights_bytes([f"model.backbone={shape}", "model.method=mtl"])
    n_models, need = 0, 0
    if {"step", "generate", "flops"} & groups:
        rows = [r for r, _, _ in method_rows() if not only or r in only or r == "mtl"]
        n_models = len(rows) + 1  # and stock T5
        mfu = sum(r == "stock" or r in rows for r in MFU_ROWS)  # group flops steps these (those that are built)
        stepping = n_models if "step" in groups else mfu if "flops" in groups else 0
        need = weights * (3 * stepping + (n_models - stepping))
    if "deepspeed" in groups:
        need = max(need, DEEPSPEED_COPIES * weights)
    return need, n_models


def too_big(shape: str, groups: set[str], only: list[str] | None, memory: int, of: str) -> str | None:
    """Why the in-process groups cannot run in `memory` bytes (`of`: whose memory that is), or None."""
    need, n_models = need_bytes(shape, groups, only)
    if need <= memory:
        return None
    held = f"{n_models} models" if n_models else "group deepspeed's copies"
    return (f"{shape} needs at least {need / 2**30:.1f} GiB of host memory for {held}, {of} "
            f"{memory / 2**30:.1f} GiB; expected fewer rows (--methods ROW ...), a smaller --shape, or "
            f"--skip step generate flops deepspeed")


# ---- FLOPs ---------------------------------------------------------------------------------------------------
def _cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, query, key, value)


# torch counts SDPA's CUDA kernels only; on CPU attention runs this fused op (uncounted otherwise)
_CPU_SDPA = {getattr(torch.ops.aten, op): fn for op, fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward)) if hasattr(torch.ops.aten, op)}


def step_flops(model, row: str, batch: dict) -> int:
    """FLOPs of one forward + backward (matmuls and attention; AdamW's elementwise work is not model FLOPs)."""
    model.train()
    with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA) as counter:
        model(**_inputs(row, batch)).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def count_flops(models: dict, rows: list[str], batch: dict) -> tuple[dict[str, int], dict[str, str]]:
    flops, errors = {}, {}
    for row in rows:
        try:
            flops[row] = step_flops(models[row], row, batch)
        except Exception as e:
            errors[f"flops:{row}"] = error_line(e)
    return flops, errors


def needed_flops(shape: str, models: dict, rows: list[str], batch: dict, flops: dict[str, int]
                 ) -> tuple[dict[str, int], dict[str, str]]:
    """FLOPs of each row's step on a model that holds only the tasks of the batch (task ids renumbered): what
    the step needs. A row's goal allows for this arithmetic, not for what its model computes, so a method that
    also works for tasks the batch does not hold (a generator run for every task) pays for it against its goal
    instead of widening it. A batch with every task needs what the models computed (`flops`)."""
    present = batch["task_ids"].unique()
    n_tasks = next((len(m.tasks) for m in models.values() if hasattr(m, "tasks")), None)
    if n_tasks is None or present.numel() == n_tasks:
        return dict(flops), {}
    renumbered = {**batch, "task_ids": torch.searchsorted(present, batch["task_ids"])}
    needed, errors = {}, {}
    for row in rows:
        if row == "stock":
            continue
        try:
            model = build_row(shape, row, present.numel(), models["stock"])
            needed[row] = step_flops(model, row, renumbered)
            del model
        except Exception as e:
            errors[f"flops-needed:{row}"] = error_line(e)
    return needed, errors


def peak_matmul(n: int):
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return lambda: torch.mm(a, b, out=out)


def peak(timings: dict) -> tuple[float, int] | None:
    """(FLOP/s, size) of the fastest square matmul timed (its minimum time), or None when none was."""
    rates = [(2 * n ** 3 / timings[f"peak-matmul:{n}"].min, n) for n in PEAK_SIZES if f"peak-matmul:{n}" in timings]
    return max(rates) if rates else None


# ---- the phase -------------------------------------------------------------------------------------------------
def run(shape: str, n_tasks: int, groups: set[str], reps: int, batching: str, log,
        batch_shape: BatchShape = BATCH, only: list[str] | None = None) -> tuple[list, dict]:
    log(f"building stock T5 and {len(set(only) | {'mtl'}) if only else len(method_rows())} method rows at {shape} "
        f"({n_tasks} tasks)")
    models, errors = build_rows(shape, n_tasks, only)
    batch = make_batch(models["stock"].config.vocab_size, n_tasks, batching, batch_shape)
    pool, flops, needed = Pool(), {}, {}
    step_rows = list(models) if "step" in groups else [r for r in MFU_ROWS if r in models] if "flops" in groups else []
    for row in step_rows:
        pool.add(f"step:{row}", train_step(models[row], row, batch), setup=models[row].train)
    if "generate" in groups:
        for row, model in models.items():
            pool.add(f"generate:{row}", generation(model, row, batch), setup=_frozen(model))
            if has_generators(model):
                pool.add(f"generate-dynamic:{row}", generation(model, row, batch), setup=_dynamic(model))
    if "flops" in groups:
        for n in PEAK_SIZES:
            pool.add(f"peak-matmul:{n}", peak_matmul(n))
    if step_rows:  # every step row, whichever groups run: a row's goal (1.03 x its FLOP ratio) depends on it
        flops, flop_errors = count_flops(models, step_rows, batch)
        needed, needed_errors = needed_flops(shape, models, step_rows, batch, flops) if "step" in groups else ({}, {})
        errors.update({**flop_errors, **needed_errors})
    log(f"timing {len(pool.entries)} entries interleaved: 1 warm-up + {reps} rounds")
    timings, failed = pool.run(reps, log)
    rows = [r for r in models if r not in ("stock", "mtl")]
    out = [f for f in figures(groups, rows, timings, flops, needed) if f is not None]
    for f in out:  # the batch these were timed on, read off its tensors
        f.parts["batch_shape"] = batch_shape_of(batch)
    return out, {**errors, **failed}


def batch_shape_of(batch: dict) -> list[int]:
    """[rows, source tokens, target tokens] of a batch."""
    return [*batch["input_ids"].shape, batch["labels"].shape[1]]


def figures(groups: set[str], rows: list[str], timings: dict, flops: dict[str, int],
            needed: dict[str, int] | None = None) -> list[Figure | None]:
    """The figures of groups step, generate and flops. `flops`: each step row's model FLOPs as run; `needed`: the
    same on a model holding only the batch's tasks (`needed_flops`), which a method row's goal allows for."""
    needed = needed or {}

    def allowance(row: str) -> float | None:
        """The FLOP ratio a method row's goal allows for: of what the step needs where counted, else as run."""
        if row in needed and "mtl" in needed:
            return needed[row] / needed["mtl"]
        return flops[row] / flops["mtl"] if row in flops and "mtl" in flops else None

    def step(row: str, base: str, goal: float, what: str) -> Figure | None:
        figure = ratio(f"step/{row}_vs_{base}", f"step:{row}", f"step:{base}", timings, goal, what)
        if figure and row in flops and base in flops:
            figure.parts["flop_ratio"] = flops[row] / flops[base]  # how much of the time ratio is arithmetic
        if figure and row in needed and base in needed:
            figure.parts["flop_ratio_needed"] = needed[row] / needed[base]  # of a model with the batch's tasks only
        return figure

    def generate(row: str, dynamic: bool = False) -> Figure | None:
        mode = "_dynamic" if dynamic else ""
        what = "prompts generated per call (contrast)" if dynamic else "frozen prompts"
        goal = GENERATE_GOAL if row.startswith("hyperprompt") and not dynamic else None  # the others: for contrast
        return ratio(f"generate/{row}{mode}_vs_mtl", f"generate{mode.replace('_', '-')}:{row}", "generate:mtl",
                     timings, goal, f"greedy generation, {what}: {row} ÷ MTL")

    def mfu(row: str) -> Figure | None:
        best = peak(timings)
        if row not in flops or f"step:{row}" not in timings or best is None:
            return None
        rate, n = best
        achieved = flops[row] / timings[f"step:{row}"].min
        return Figure(f"flops/{row}_mfu", achieved / rate, MFU_GOAL, "higher", "fraction",
                      f"achieved model FLOP/s of the {row} train step ÷ fp32 matmul peak (the fastest square "
                      f"matmul, {n}²)",
                      parts={"model_gflop_per_step": flops[row] / 1e9, "achieved_gflops": achieved / 1e9,
                             "peak_gflops": rate / 1e9, "peak_size": n, "step_time": timings[f"step:{row}"].to_json(),
                             "peak_gflops_by_size": {str(m): 2 * m ** 3 / timings[f"peak-matmul:{m}"].min / 1e9
                                                     for m in PEAK_SIZES if f"peak-matmul:{m}" in timings}})

    out = []
    if "step" in groups:
        out.append(step("mtl", "stock", WRAPPER_GOAL,
                        "train step (fwd+bwd+AdamW): MTL wrapper ÷ stock T5ForConditionalGeneration"))
        for r in rows:  # HyperPrompt: within 3 % of MTL; the others: within 3 % of what their extra arithmetic costs
            paper, allowed = r.startswith("hyperprompt"), allowance(r)
            goal = STEP_GOAL if paper or allowed is None else STEP_GOAL * allowed
            what = f"train step (fwd+bwd+AdamW): {r} ÷ MTL"
            if not paper and allowed is not None:
                as_run = flops[r] / flops["mtl"] if r in flops and "mtl" in flops else allowed
                what += f" (goal: 1.03 x its FLOP ratio {allowed:.3f}" + (
                    f"; it computes {as_run:.3f}, work for tasks the batch does not hold)"
                    if as_run > allowed * 1.001 else ")")
            out.append(step(r, "mtl", goal, what))
    if "generate" in groups:
        out.append(ratio("generate/mtl_vs_stock", "generate:mtl", "generate:stock", timings, WRAPPER_GOAL,
                         "greedy generation: MTL wrapper ÷ stock T5"))
        out += [f for r in rows for f in (generate(r), generate(r, dynamic=True))]
    if "flops" in groups:
        out += [mfu(r) for r in MFU_ROWS]
    return out
