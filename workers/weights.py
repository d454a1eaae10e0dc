"""Loading a model shard: from a Hugging Face safetensors checkpoint, a GGUF file, or random weights for benchmarks.

Each rank opens the checkpoint files itself and reads only its slice of each tensor: `iterate_weights` yields lazy
safetensors slices (`checkpoints.gguf.iterate_gguf_weights` lazy GGUF slices that dequantize what they return), and the
parameters' weight loaders index them (`slice[a:b]`), so a rank never materializes a full tensor it does not need.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from engine.quantization import GGUF_INT_LAYOUTS, QuantConfig, gguf_quant_config
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear, remake_weight
from workers.layers.moe import FusedMoE
from workers.layers.quantization import quantized_layers
from workers.models import get_model_class
from workers.models.args import ModelArgs

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's *.safetensors files: those named by the index when there is one, else all of them."""
    index_path = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, name) for name in names]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir!r}")
    return files


def iterate_weights(model_dir: str) -> Iterator[tuple[str, object]]:
    """Yields (tensor name, safetensors slice) for every tensor of the checkpoint.

    A slice is valid only until the next item is requested (its file is closed when the iteration leaves it)."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_model(hf_config: dict, model_dir: str | None, dtype: torch.dtype, device, load_format: str = "auto",
               seed: int = 0, max_model_len: int | None = None, quant_config: QuantConfig | None = None) -> nn.Module:
    """Builds this rank's shard of the model on `device` and fills its weights.

    load_format: "auto" / "safetensors" read `model_dir` (a .gguf file with "auto"); "random" draws every weight from
    N(0, initializer_range) with `seed` (norm weights 1, biases 0) without reading any checkpoint.
    quant_config: FP8 or int linear layers and experts (workers/layers/quantization*.py, moe_quant.py), FP8 ones
    quantized as they load (or drawn in FP8).
    """
    model_class, args = get_model_class(hf_config), ModelArgs.from_hf_config(hf_config)
    with quantized_layers(quant_config):
        model = model_class(args, dtype=dtype, device=device, max_model_len=max_model_len)
    num_moe = sum(isinstance(m, FusedMoE) for m in model.modules())
    if quant_config is not None and num_moe and not quant_config.is_packed_int:
        logger.info("FP8: the linear layers and the routed experts of %d MoE layers (their inputs quantized per "
                    "token; routers in %s)", num_moe, dtype)
    if load_format == "random":
        init_random_weights(model, std=args.initializer_range, seed=seed)
    elif load_format in ("auto", "safetensors"):
        assert model_dir is not None, "a checkpoint directory is needed unless load_format='random'"
        if model_dir.endswith(".gguf"):
            from checkpoints.gguf import expert_types, iterate_gguf_weights, linear_module_types, open_gguf

            # dequantized (FP8 quantizes them online), or the linears and experts as int blocks ("gguf")
            int_modules: set[str] = set()
            if quant_config is not None and quant_config.method == "gguf":
                reader = open_gguf(model_dir)
                int_modules = gguf_int_layers(model, linear_module_types(reader), dtype)
                int_modules |= gguf_int_experts(model, expert_types(reader), hf_config["model_type"])
            weights = iterate_gguf_weights(model_dir, hf_config, int_modules)
        else:
            weights = iterate_weights(model_dir)
        model.load_weights(checkpoint_names(weights, quant_config))
    else:
        raise ValueError(f"unknown load_format {load_format!r}")
    for module in model.modules():  # what a layer makes of its loaded weights (MLA: kv_b_proj dequantized; int
        if hasattr(module, "finish_loading"):  # layers repacked)
            module.finish_loading()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # their temporaries back: the KV profile counts what the allocator holds as in use
    return model.eval()


_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def gguf_int_layers(model: nn.Module, types: dict[str, str], dtype) -> set[str]:
    """Gives each decoder linear the int layer its GGUF parts' one type allows (checkpoints/gguf_types.py: bits,
    group, zero point or mins, scale dtype), or a float weight (parts of a type not served, or of different
    types: q/k/v and gate/up are one matmul); returns the checkpoint modules (q_proj, ...) served as int blocks."""
    int_modules: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or not name.startswith("model.layers."):
            continue
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{part}" for part in _FUSED_PARTS.get(leaf, (leaf,))]
        part_types = {types.get(part) for part in parts}
        qtype = part_types.pop() if len(part_types) == 1 else None
        wanted = gguf_quant_config(qtype) if qtype is not None and qtype in GGUF_INT_LAYOUTS else None
        if wanted != module.quant_config:
            remake_weight(module, wanted, dtype)
        if wanted is not None:
            int_modules.update(parts)
    return int_modules


def gguf_int_experts(model: nn.Module, types: dict[int, dict[str, str]], model_type: str) -> set[str]:
    """Makes int experts of each FusedMoE whose GGUF gate and up tensors (`types`: checkpoints.gguf.expert_types)
    share a type the int kernels take and whose down tensor is of such a type too (its own:
    workers/layers/moe_quant.py); float ones of the others, to be dequantized at load (each was built holding
    none: FusedMoE.make_experts). Returns the checkpoint's experts modules served as int blocks
    (checkpoints.gguf.experts_module)."""
    from checkpoints.gguf import experts_module

    int_modules: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        layer = int(name.split(".")[2])  # model.layers.{layer}...
        parts = types.get(layer, {})
        gate, up, down = (parts.get(p) for p in ("gate_proj", "up_proj", "down_proj"))
        if gate == up and gate in GGUF_INT_LAYOUTS and down in GGUF_INT_LAYOUTS:
            module.make_experts({"w13": gguf_quant_config(gate), "w2": gguf_quant_config(down)})
            int_modules.add(experts_module(layer, model_type))
        else:
            module.make_experts(None)
            logger.warning("quantization='gguf': layer %d's experts (gate %s, up %s, down %s) are dequantized at "
                           "load: the MoE kernels take int blocks of %s, gate and up of one type", layer, gate, up,
                           down, ", ".join(GGUF_INT_LAYOUTS))
    return int_modules


@torch.no_grad()
def init_random_weights(model: nn.Module, std: float, seed: int) -> None:
    """Random weights drawn on the parameters' own device, deterministic from `seed` (FP8 weights by their own
    `random_init`, in chunks)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if hasattr(param, "random_init"):
            param.random_init(std, generators[param.device])
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generators[param.device])


# compressed-tensors' pack-quantized names -> the int layers' (workers/layers/quantization_int.py)
PACK_QUANTIZED_NAMES = {"weight_packed": "qweight", "weight_scale": "scales", "weight_zero_point": "qzeros",
                        "weight_g_idx": "g_idx"}


def checkpoint_names(weights: Iterator[tuple[str, object]], quant_config: QuantConfig | None):
    """A quantized checkpoint's tensor names as the layers call them: `weight_scale_inv` (transformers' fp8) is a
    `weight_scale` (both multiply the e4m3 weight); compressed-tensors' pack-quantized tensors take AWQ's and
    GPTQ's names, and its `weight_shape` (the unpacked [N, K], which the packed shapes imply) is dropped.
    KV-cache scales in a checkpoint are not used (Pagoda calibrates its own at load, workers/kv_scales.py):
    skipped, with a warning."""
    skipped = 0
    is_pack_quantized = quant_config is not None and quant_config.method == "pack-quantized"
    for name, loaded in weights:
        if name.endswith((".k_scale", ".v_scale", ".kv_scale")):
            skipped += 1
            continue
        if is_pack_quantized:
            module, _, suffix = name.rpartition(".")
            if suffix == "weight_shape":
                continue
            name = f"{module}.{PACK_QUANTIZED_NAMES.get(suffix, suffix)}"
        if quant_config is not None and quant_config.scale_name != "weight_scale" and name.endswith(
                "." + quant_config.scale_name):
            name = name[: -len(quant_config.scale_name)] + "weight_scale"
        yield name, loaded
    if skipped:
        logger.warning("the checkpoint's %d KV-cache scale tensors are not used", skipped)
