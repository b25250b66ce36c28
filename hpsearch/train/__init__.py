"""`python -m hpsearch.train`: train one configuration. Ray Train runs the workers; each runs DeepSpeed ZeRO-3.

    python -m hpsearch.train [--config FILE.yaml] [--local] [--resume-from DIR] [key=value ...]

The one package that knows DeepSpeed. The same `train_loop` runs in Ray Train workers (`build_trainer`, also used
by the search) and, with `--local`, in this process without Ray, for debugging. One concern a file: `dsconfig`
(the DeepSpeed config), `sessions` (where reports and checkpoints go), `loop` (the loop on each rank), `evaluate`
(validation and test scoring), `launch` (Ray and Ray Train), `__main__` (the command line).
"""
from hpsearch.train.dsconfig import deepspeed_config, lr_lambda, use_bf16
from hpsearch.train.launch import TrainingFailed, build_trainer, failure_reason, free_port, init_ray, run_with_ray
from hpsearch.train.loop import NonFiniteLoss, train_loop

__all__ = ["NonFiniteLoss", "TrainingFailed", "build_trainer", "deepspeed_config", "failure_reason", "free_port",
           "init_ray", "lr_lambda", "run_with_ray", "train_loop", "use_bf16"]
