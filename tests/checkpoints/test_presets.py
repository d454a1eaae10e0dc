"""The real-sized presets build the model they name: each family's class on the meta device (no memory), with
the published parameter counts."""

import pytest
import torch

from checkpoints.presets import PRESETS
from workers.models import get_model_class
from workers.models.args import ModelArgs

PARAMETERS = {"llama-3-8b": 8.03e9, "qwen2.5-7b": 7.62e9, "llama-3-70b": 70.6e9, "mixtral-8x7b": 46.7e9,
              "qwen3-8b": 8.19e9, "qwen3-30b-a3b": 30.5e9}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_its_family_at_its_size(name):
    cfg = PRESETS[name]
    model = get_model_class(cfg)(ModelArgs.from_hf_config(cfg), torch.bfloat16, "meta", max_model_len=4096)
    assert type(model).__name__ == cfg["architectures"][0]
    num_params = sum(p.numel() for p in model.parameters())
    assert abs(num_params / PARAMETERS[name] - 1) < 0.005, f"{name}: {num_params / 1e9:.2f}B"
