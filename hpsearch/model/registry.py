"""The methods (one line each) and the constructors that build a multi-task T5 from them."""
from __future__ import annotations

from dataclasses import fields, replace

from hpsearch.errors import ConfigError
from hpsearch.model.adapter import AdapterT5
from hpsearch.model.backbones import backbone_config, load_backbone
from hpsearch.model.base import MultiTaskT5
from hpsearch.model.config import ModelConfig
from hpsearch.model.export import export_meta, is_export, load_export
from hpsearch.model.hyperformer import HyperFormerT5
from hpsearch.model.hyperprompt import HyperPromptT5
from hpsearch.model.lora import LoRAT5
from hpsearch.model.mam import MAMT5
from hpsearch.model.mtl import MultiTaskBaseline
from hpsearch.model.pha import PHAT5
from hpsearch.model.prefix import PrefixT5
from hpsearch.model.prompt_tuning import PromptTuningT5

METHOD_CLASSES = {
    "mtl": MultiTaskBaseline,
    "hyperprompt": HyperPromptT5,
    "prompt_tuning": PromptTuningT5,
    "adapter": AdapterT5,
    "hyperformer": HyperFormerT5,
    "prefix": PrefixT5,
    "lora": LoRAT5,
    "mam": MAMT5,
    "pha": PHAT5,
}


def model_config(backbone="t5-tiny", method="hyperprompt", **hparams) -> ModelConfig:
    """A validated ModelConfig from keyword arguments (unknown names are a ConfigError)."""
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(hparams) - known)
    if unknown:
        raise ConfigError(f"model.{unknown[0]}: unknown field; known: {', '.join(sorted(known))}")
    cfg = replace(ModelConfig(), backbone=backbone if isinstance(backbone, str) else "<T5Config>",
                  method=method, **hparams)
    cfg.validate()
    return cfg


def build_from_config(cfg: ModelConfig, tasks, backbone=None) -> MultiTaskT5:
    """`build_model` from a ModelConfig (the `model` section of a run config); `backbone` overrides cfg's."""
    hparams = {k: v for k, v in vars(cfg).items() if k not in ("backbone", "method")}
    return build_model(cfg.backbone if backbone is None else backbone, cfg.method, tasks, **hparams)


def build_skeleton(cfg: ModelConfig, tasks) -> MultiTaskT5:
    """The model `build_from_config(cfg, tasks)` makes, built from configs alone: no checkpoint is read and the
    weights are fresh initial values (`init_task_params` not applied). For counting on the meta device and for
    building under `deepspeed.zero.Init`, where each rank then receives its shard of the real weights."""
    from transformers import T5Config

    if is_export(cfg.backbone):
        meta = export_meta(cfg.backbone)
        model = build_from_config(ModelConfig(**meta["model"]), meta["tasks"],
                                  backbone=T5Config.from_dict(meta["t5_config"]))
        model.cfg.backbone = meta["model"]["backbone"]
        return model
    model = build_from_config(cfg, tasks, backbone=backbone_config(cfg.backbone, cfg.vocab_size, cfg.dropout))
    model.cfg.backbone = cfg.backbone
    return model


def build_model(backbone="t5-tiny", method="hyperprompt", tasks=("task",), *, t5=None, **hparams) -> MultiTaskT5:
    """Build a multi-task T5. `backbone`: named shape, T5Config, hub id, local checkpoint, or an hpsearch export
    directory (`save_export`; then method, tasks and hparams come from the export). `t5`: reuse this T5."""
    if is_export(backbone):
        return load_export(backbone, build_from_config)
    if not tasks:
        raise ConfigError("tasks: empty; a multi-task model needs at least one task")
    cfg = model_config(backbone, method, **hparams)
    if t5 is None:
        t5 = load_backbone(backbone, cfg.vocab_size, cfg.dropout)
    return METHOD_CLASSES[cfg.method](t5, tasks, cfg)
