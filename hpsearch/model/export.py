"""Exports: the full model (loadable by `build_model`) and the task-specific parameters alone.

A full export is a directory with `hpsearch_model.json` (the model config, the tasks, the T5 config) and
`model.safetensors`; `build_model(<that directory>)` rebuilds and loads it. The task-parameter export holds
only the parameters the method adds (`task_params.safetensors`) plus the same JSON.

A tensor under several names is written once: T5 ties its token embeddings (`shared`, both stacks'
`embed_tokens`, and `lm_head`), which written apart made a t5-small HyperPrompt export 442 MB instead of 251 MB.
The file's metadata (`hpsearch_tied`, JSON) maps each other name to the one written, and loading puts the tensor
back under every name.
"""
from __future__ import annotations

import dataclasses
import errno
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hpsearch.errors import ConfigError, disk_full

MARKER = "hpsearch_model.json"


def is_export(path) -> bool:
    return isinstance(path, (str, Path)) and (Path(path) / MARKER).is_file()


def _check_full_export(directory: Path) -> None:
    from hpsearch.errors import ConfigError
    if not (directory / "model.safetensors").is_file():
        kind = "a task-parameter export" if (directory / "task_params.safetensors").is_file() else "incomplete"
        raise ConfigError(f"model.backbone: {directory} is {kind}, not a full model export (no model.safetensors); "
                          "use the run's model/ directory")


def _meta(model) -> dict:
    return {"model": dataclasses.asdict(model.cfg), "tasks": model.tasks, "t5_config": model.t5.config.to_dict()}


TIED = "hpsearch_tied"  # the metadata key: {other name: the name a tied tensor is written under}


def _tensors(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """({name: tensor on the CPU}, {alias: name}): a tensor that appears under several names (the same storage,
    offset, shape, strides and dtype: a tied weight) is kept under its first name only. Nothing is cloned: the
    file is written from the tensors as they are (an already gathered copy is not copied again), and safetensors
    takes views of one buffer that do not overlap (DeepSpeed's ZeRO-1/2 make every parameter one)."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple, str] = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        if tensor.numel():
            view = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tuple(tensor.stride()), tensor.dtype)
            if view in first:
                aliases[name] = first[view]
                continue
            first[view] = name
        kept[name] = tensor.to("cpu").contiguous()
    return kept, aliases


def _save(tensors: dict[str, torch.Tensor], path: Path, aliases: dict[str, str] | None = None) -> None:
    """`save_file`; a full disk comes out as the OSError (ENOSPC, naming the file) other writers raise, where
    safetensors says it in a `SafetensorError` ("... No space left on device (os error 28)") without the file."""
    try:
        save_file(tensors, str(path), metadata={TIED: json.dumps(aliases)} if aliases else None)
    except SafetensorError as e:
        if disk_full(e):
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from e
        raise


def save_export(model, directory, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a full export; `state` overrides `model.state_dict()` (e.g. gathered from ZeRO-3 partitions)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _tensors(state if state is not None else model.state_dict())
    _save(tensors, directory / "model.safetensors", aliases)
    (directory / MARKER).write_text(json.dumps(_meta(model), indent=2, default=str))
    return directory


def save_task_params(model, directory, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write only the method's own parameters (everything outside the backbone `t5.`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = state if state is not None else model.state_dict()
    tensors, aliases = _tensors({k: v for k, v in state.items() if not k.startswith("t5.")})
    _save(tensors, directory / "task_params.safetensors", aliases)
    (directory / MARKER).write_text(json.dumps(_meta(model), indent=2, default=str))
    return directory


def export_meta(directory) -> dict:
    """A full export's {"model": model config, "tasks", "t5_config"} (a ConfigError when it is not a full export)."""
    directory = Path(directory)
    _check_full_export(directory)
    return json.loads((directory / MARKER).read_text())


def load_export(directory, build):
    """Rebuild the model of a full export with `build(model_config, tasks, backbone=t5_config)`, load weights."""
    from transformers import T5Config

    from hpsearch.model.config import ModelConfig

    directory = Path(directory)
    meta = export_meta(directory)
    model = build(ModelConfig(**meta["model"]), meta["tasks"], backbone=T5Config.from_dict(meta["t5_config"]))
    model.cfg.backbone = meta["model"]["backbone"]
    weights = load_weights(directory / "model.safetensors")
    own = model.state_dict()
    reshaped = [n for n, t in weights.items() if n in own and tuple(t.shape) != tuple(own[n].shape)]
    if reshaped:  # torch's load_state_dict raises on these, strict or not
        missing, unexpected = [n for n in own if n not in weights], [n for n in weights if n not in own]
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected or reshaped:
        older = older_layout(unexpected, missing, reshaped)
        raise ConfigError(f"{directory}: export does not match the model (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}, another shape {reshaped[:3]})" + (f"; {older}" if older else ""))
    return model


# parameter names only the layouts before 2026-11-27 had (3db69a4 and earlier), and the names today's model has
# instead: an older layout is blamed only when the weights have the old names and the model misses the new ones (a
# HyperPrompt with unequal lengths per side still has global_prompts.encoder.*: a placement or method mismatch)
OLDER_LAYOUTS = {
    "prefix_mlp.": (("prefix_mlps.",), "prefix tuning and MAM then had one prefix MLP, for the self-attentions only"),
    "global_prompts.decoder.": (("global_prompts.shared.",),
                                "HyperPrompt then kept a prompt set per side also when both sides had one length"),
    "global_prompts.encoder.": (("global_prompts.shared.",),
                                "HyperPrompt then kept a prompt set per side also when both sides had one length"),
}


# parameters whose shape changed, and the names today's model has beside them, with the last commit of the layout
RESHAPED_LAYOUTS = {
    "block_embeddings.weight": ("encoder_adapters.", "PHA then generated the encoder's adapters from the task too",
                                "8667c60"),
}


def older_layout(unexpected, missing, reshaped=()) -> str | None:
    """Why weights an older hpsearch wrote no longer fit (None: not a known older layout): names the weights have
    that the model does not (`unexpected`), names the model has that the weights do not (`missing`), and names
    both have in other shapes (`reshaped`)."""
    for prefix, (new, why) in OLDER_LAYOUTS.items():
        if any(str(n).startswith(prefix) for n in unexpected) and any(str(n).startswith(new) for n in missing):
            return (f"it was written by hpsearch before 2026-11-27 ({why}): train it again, or load it with that "
                    "version (git checkout 3db69a4)")
    for name, (new, why, commit) in RESHAPED_LAYOUTS.items():
        if name in reshaped and any(str(n).startswith(new) for n in missing):
            return (f"it was written by an earlier hpsearch ({why}): train it again, or load it with that version "
                    f"(git checkout {commit})")
    return None


def load_weights(path) -> dict[str, torch.Tensor]:
    """{name: tensor} of an export's safetensors file, a tied tensor under every name it was saved from."""
    with safe_open(str(path), "pt") as f:  # one read of the file: its metadata and its tensors
        aliases = json.loads((f.metadata() or {}).get(TIED, "{}"))
        state = {name: f.get_tensor(name) for name in f.keys()}
    state.update({alias: state[name] for alias, name in aliases.items()})
    return state
