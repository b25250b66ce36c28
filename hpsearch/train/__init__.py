"""`python -m hpsearch.train`: train one configuration. Ray Train runs the workers; each runs DeepSpeed (ZeRO stage
0-3: `train.zero_stage`, auto by default: 0 when the training state fits a worker).

    python -m hpsearch.train [--config FILE.yaml] [--local] [--resume-from DIR] [key=value ...]

The one package that knows DeepSpeed. The same `train_loop` runs in Ray Train workers (`build_trainer`, also used by
the search) and, with `--local`, in this process without Ray, for debugging. One concern a file: `dsconfig` (the
DeepSpeed config), `sessions` (where reports and checkpoints go), `loop` (the loop on each rank), `evaluate`
(validation and test scoring), `checkpoints` (loading them weights-only, resume checks, which one a run continues
from), `bestweights` (the best weights: written once, each rank reading its own part), `launch` (Ray and Ray Train),
`rendezvous` and `torchconfig` (the ranks' torch.distributed store, on the node's address), `startup` (where a run's
start-up goes), `__main__` (the command line).

The names below are imported when first used: Ray Train's controller and workers unpickle the loop's entry point
and the rendezvous config from this package, and importing DeepSpeed, transformers and the model library there
(about 6 s here) would delay every trial's start.
"""
import importlib

_EXPORTS = {"deepspeed_config": "dsconfig", "lr_lambda": "dsconfig", "use_bf16": "dsconfig",
            "optimizer_and_schedule": "dsconfig",
            "TrainingFailed": "launch", "build_trainer": "launch", "failure_reason": "launch", "free_port": "launch",
            "init_ray": "launch", "loop_config": "launch", "run_with_ray": "launch", "shutdown_ray": "launch",
            "NonFiniteLoss": "loop", "train_loop": "loop"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"hpsearch.train.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'hpsearch.train' has no attribute {name!r}")
