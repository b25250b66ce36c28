"""HyperPrompt T5 and its baselines behind one constructor, one file per method (METHOD_CLASSES).

    model = build_model("t5-tiny", "hyperprompt", tasks=["rte", "cb"], variant="global", placement="both")
    model = build_model("t5-tiny", "hyperformer", tasks=["rte", "cb"], reduction_factor=32)
    model = build_model("t5-tiny", "lora", tasks=["rte", "cb"], lora_rank=8)     # also prefix, mam, pha
    out = model(input_ids, attention_mask, labels=labels, task_ids=task_ids)   # HF Seq2SeqLMOutput
    ids = model.generate(input_ids, attention_mask, task_ids=task_ids, max_new_tokens=5)
"""
from __future__ import annotations

from hpsearch.lazy import lazy_names

# where each public name lives: imported on first use (PEP 562), so reading and validating a config (the CLIs' checks
# before anything starts) does not import torch and transformers
_WHERE = {
    "MultiTaskT5": "base", "ModelConfig": "config", "METHOD_FIELDS": "config",
    "NAMED_SHAPES": "backbones", "backbone_config": "backbones", "check_local_backbone": "backbones",
    "check_backbone_width": "backbones", "load_backbone": "backbones",
    "export_meta": "export", "is_export": "export", "load_export": "export", "save_export": "export",
    "save_task_params": "export",
    "METHOD_CLASSES": "registry", "build_from_config": "registry", "build_model": "registry",
    "build_skeleton": "registry", "model_config": "registry",
}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
