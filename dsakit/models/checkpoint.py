"""Strict loading of a DeepseekV4ForCausalLM checkpoint directory: every tensor the model has must be in the
weights with its shape, no tensor may be left over, and every weight must be finite.

transformers' ``from_pretrained`` initialises a missing tensor at random and only logs it; a server or a warm
start that goes on from there answers with a model nobody trained. :func:`load_causal_lm_strict` refuses it
with one ``ValueError`` naming the first offending tensor (and how many more there are).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _first(kind: str, names, source: str) -> ValueError:
    names = sorted(names)
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return ValueError(f"{source}: {kind} tensor {names[0]!r}{more}")


def check_loaded(model: torch.nn.Module, info: dict, *, source: str) -> None:
    """ValueError naming the first missing, unexpected, mis-shaped or non-finite tensor.

    ``info`` is what ``from_pretrained(..., output_loading_info=True)`` returns beside the model (names after
    transformers' own renaming of checkpoint keys)."""
    if info.get("missing_keys"):
        raise _first("missing", info["missing_keys"], source)
    if info.get("unexpected_keys"):
        raise _first("unexpected", info["unexpected_keys"], source)
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        name, got, want = sorted(mismatched)[0][:3]
        raise ValueError(f"{source}: tensor {name!r} has shape {list(got)}, the config needs {list(want)}")
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{source}: tensor {name!r} has non-finite values (NaN or Inf)")


def read_checkpoint_config(path: "str | Path") -> dict:
    """config.json of a DeepseekV4ForCausalLM checkpoint directory as a dict; ValueError naming what is wrong
    (no such directory, no config.json, not a JSON object, another model_type)."""
    path = Path(path)
    config_file = path / "config.json"
    try:  # no directory or config.json, not JSON, or JSON that is not an object (no .get)
        raw = json.loads(config_file.read_text())
        model_type = raw.get("model_type")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        reason = ("does not exist (or is not a directory)" if not path.is_dir() else
                  f"has no config.json that is a JSON object (not a transformers checkpoint directory): {exc}")
        raise ValueError(f"model directory {str(path)!r} {reason}") from None
    if model_type != "deepseek_v4":
        raise ValueError(f"{config_file} has model_type {model_type!r}; dsakit runs 'deepseek_v4' checkpoints")
    return raw


def load_causal_lm_strict(path: "str | Path", dtype: torch.dtype = torch.float32):
    """A DeepseekV4ForCausalLM loaded from ``path`` with exactly the weights its config needs, in eval mode on
    the CPU. ValueError names what is wrong: no or unreadable config (:func:`read_checkpoint_config`), a config
    transformers refuses, weights that cannot be read, a missing / unexpected / mis-shaped / non-finite tensor."""
    from transformers import DeepseekV4ForCausalLM

    path = Path(path)
    read_checkpoint_config(path)
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors weights")
    try:
        model, info = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                                            output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - safetensors / transformers raise many types on a corrupt file
        raise ValueError(f"cannot load the checkpoint in {path}: {type(exc).__name__}: {exc}") from None
    check_loaded(model, info, source=str(path))
    return model.eval()
