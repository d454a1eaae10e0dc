"""LoRA adapters for tests, written by peft itself (random, non-zero B: init_lora_weights=False), and
transformers + peft as the oracle of a model running one."""

from __future__ import annotations

import json
import os

import torch


def make_adapter(model_dir: str, path: str, rank: int = 8, alpha: float = 16.0, targets=("q_proj", "v_proj"),
                 seed: int = 0, use_rslora: bool = False, b_std: float = 0.5, **config) -> str:
    """peft's get_peft_model on the checkpoint at model_dir, saved with save_pretrained into `path`; returns it.
    B is random (not peft's zeros), N(0, b_std), large enough that the adapter changes the model's greedy choices."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    lora_config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets) if not isinstance(targets, str)
                             else targets, init_lora_weights=False, use_rslora=use_rslora, **config)
    model = get_peft_model(base, lora_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    model.save_pretrained(path)
    return path


def peft_model(model_dir: str, adapter_dir: str | None):
    """transformers' model of the checkpoint, with the adapter applied by peft (None: the base model)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_dir).eval()


def edit_config(adapter_dir: str, **changes) -> None:
    """Changes fields of an adapter's adapter_config.json (tests of what Pagoda refuses)."""
    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
