"""The FP8 oracle: a transformers model computing what Pagoda's FP8 paths define (kernels/fp8.py), restated here
in plain torch so that the definitions are checked, not copied.

- Every decoder Linear becomes `FakeQuantLinear`: its weight quantized and dequantized with a scale per output
  row (per row of each tensor-parallel K shard for o_proj and down_proj: each rank quantizes its own shard), or
  taken dequantized from an FP8 checkpoint; its input quantized and dequantized per token with the least
  power-of-two scale that fits the row's largest |x| into 448 (or a static power-of-two scale).
- A mixture-of-experts model's routed experts (transformers' stacked gate_up_proj / down_proj) hold their weights
  quantized and dequantized the same way (per row; down per row of each K shard), or an FP8 checkpoint's
  dequantized, and compute as transformers' loop does with each GEMM's input quantized and dequantized per token
  as a linear's is (x per token, the SiLU-and-mul output per token and expert: Pagoda's FP8 experts are W8A8).
  Routers and shared_expert_gate stay as they are.
- With `kv_fp8`, an attention function quantizes and dequantizes K (after rotary) and V per KV head with
  power-of-two scales from the same calibration batch Pagoda uses (workers/kv_scales.py), measured here on the
  oracle itself.

Also writes the pre-quantized checkpoint formats (`write_fp8_checkpoint`) from a tiny bf16 one.
"""

from __future__ import annotations

import json
import os
import shutil
import types

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

E4M3 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj")  # Phi-3's fused ones: per-row scales are the same fused or not
ROW_PARALLEL = ("o_proj", "down_proj")
# DeepSeek-V2's latent attention: an FP8 checkpoint quantizes these too (online FP8 leaves all but q_b_proj float)
MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
EXPERT_LINEARS = ("w1", "w2", "w3")  # Mixtral's experts in a checkpoint (Qwen-MoE's: gate_proj / up_proj / down_proj)
KV_CALIBRATION = {"seqs": 4, "len": 128, "seed": 1234}  # workers/kv_scales.py's batch


def pow2_at_least(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The least 2^k with top * 2^k >= amax (top = 448 for activations, 112 for KV), by frexp."""
    mantissa, exponent = torch.frexp(amax.float())  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    top_m, top_e = torch.frexp(torch.tensor(top))
    k = exponent - top_e + (mantissa > top_m).int()
    return torch.where(amax > 0, torch.ldexp(torch.ones_like(amax.float()), k), torch.ones_like(amax.float()))


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(E4M3).float() * scale


def fake_quant_weight(w: torch.Tensor, k_shards: int = 1) -> torch.Tensor:
    """A scale per output row of each of `k_shards` column blocks: its largest |w| / 448."""
    parts = []
    for part in w.float().chunk(k_shards, dim=1):
        amax = part.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        parts.append((part * (1.0 / scale)).clamp(-448, 448).to(E4M3).float() * scale)
    return torch.cat(parts, dim=1)


def fake_quant_rows(rows: torch.Tensor) -> torch.Tensor:
    """[T, K] quantized and dequantized per token: the least power-of-two scale that fits the row into 448."""
    return fake_quant(rows, pow2_at_least(rows.abs().amax(dim=-1, keepdim=True), 448.0))


class FakeQuantLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, input_scale: float | None = None):
        super().__init__()
        self.weight, self.bias, self.input_scale = weight.float(), bias, input_scale

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1]).float()
        if self.input_scale is None:
            quantized = fake_quant_rows(rows)
        else:
            quantized = fake_quant(rows, torch.tensor(self.input_scale))
        y = F.linear(quantized, self.weight, None if self.bias is None else self.bias.float())
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(module, "kv_amax", None) is not None:  # calibrating: record each KV head's largest |K| and |V|
        for i, t in enumerate((key, value)):
            module.kv_amax[i] = torch.maximum(module.kv_amax[i], t.abs().amax(dim=(0, 2, 3)))
    elif getattr(module, "kv_scales", None) is not None:
        key, value = (fake_quant(t, s[None, :, None, None]).to(t.dtype) for t, s in zip((key, value),
                                                                                        module.kv_scales))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("pagoda_fp8_kv", _attention)
    AttentionMaskInterface.register("pagoda_fp8_kv", sdpa_mask)
    return "pagoda_fp8_kv"


def oracle_model(model_dir: str, tp: int = 1, weights: dict | None = None, input_scales: dict | None = None,
                 kv_fp8: bool = True, fp8_experts: bool = True):
    """The float32 transformers model of `model_dir` with fake-quantized linears (online per-row scales at
    tensor-parallel degree `tp`, or `weights`: name -> dequantized weight from an FP8 checkpoint, with
    `input_scales`: name -> static scale), routed experts too unless `fp8_experts` is False, and, with kv_fp8,
    calibrated fake-quantized K/V."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    linears = LINEARS + (MLA_LINEARS if weights else ())
    for i, layer in enumerate(model.model.layers):
        for path, linear in list(layer.named_modules()):
            parent_path, _, name = path.rpartition(".")
            # FakeQuantLinear: attention, dense MLPs, a shared expert (routed experts: below; gates: never)
            if not isinstance(linear, nn.Linear) or name not in linears or ".experts." in f".{path}.":
                continue
            key = f"model.layers.{i}.{path}"
            if name == "kv_b_proj":  # Pagoda dequantizes it at load: the weight only, its input not quantized
                linear.weight.data.copy_(weights[key])
                continue
            w = weights[key] if weights else fake_quant_weight(linear.weight.data, tp if name in ROW_PARALLEL else 1)
            setattr(layer.get_submodule(parent_path), name,
                    FakeQuantLinear(w, linear.bias, (input_scales or {}).get(key)))
        if fp8_experts:
            _fake_quant_experts(layer, i, tp, weights, input_scales)
    model.set_attn_implementation(_register_attention())
    if kv_fp8:
        calibrate(model)
    return model


@torch.no_grad()
def _fake_quant_experts(layer, index: int, tp: int, weights: dict | None, input_scales: dict | None) -> None:
    """A MoE layer's experts with FP8 weights: online per row (down per row of each of `tp` K shards), or the
    checkpoint's dequantized ones (`weights`, by checkpoint module name: Mixtral's block_sparse_moe.experts.{e}.w1,
    Qwen's mlp.experts.{e}.gate_proj...), and the static input scales of their gate / up and of their down
    (`input_scales`, the same for every expert of the layer) or none (per token)."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is None or not hasattr(experts, "gate_up_proj"):
        return
    for e in range(experts.gate_up_proj.shape[0]):
        if weights:
            gate, up, down = (_checkpoint_expert(weights, index, e, names) for names in
                              (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")))
            gate_up = torch.cat([gate, up])
        else:
            gate_up, down = fake_quant_weight(experts.gate_up_proj[e]), fake_quant_weight(experts.down_proj[e], tp)
        experts.gate_up_proj[e] = gate_up
        experts.down_proj[e] = down
    experts.tp = tp
    experts.input_scales = tuple(_checkpoint_expert(input_scales or {}, index, 0, names, missing=None)
                                 for names in (("w1", "gate_proj"), ("w2", "down_proj")))
    experts.forward = types.MethodType(_fp8_experts_forward, experts)


def _fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts loop, restated, with each GEMM's input fake-quantized per token (per token and expert
    for the SiLU-and-mul output, which down reads, over each tensor-parallel rank's slice of it), or by the
    layer's static input scales."""
    up_scale, down_scale = self.input_scales
    out = torch.zeros_like(hidden_states)
    for expert in top_k_index.unique().tolist():
        if expert >= self.gate_up_proj.shape[0]:  # transformers' mark of no expert
            continue
        tokens, slots = torch.where(top_k_index == expert)
        x = hidden_states[tokens].float()
        x = fake_quant_rows(x) if up_scale is None else fake_quant(x, torch.tensor(up_scale))
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, -1)
        h = self.act_fn(gate) * up
        if down_scale is None:
            h = torch.cat([fake_quant_rows(part) for part in h.chunk(self.tp, dim=-1)], dim=-1)
        else:
            h = fake_quant(h, torch.tensor(down_scale))
        y = F.linear(h, self.down_proj[expert]) * top_k_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _checkpoint_expert(weights: dict, layer: int, expert: int, names: tuple[str, str], **missing):
    """weights' entry for one expert's projection, by Mixtral's name (names[0]) or Qwen's (names[1]); `missing`
    (a keyword) what to return when neither is there (else KeyError)."""
    mixtral, qwen = (f"model.layers.{layer}.{block}.experts.{expert}.{name}"
                     for block, name in (("block_sparse_moe", names[0]), ("mlp", names[1])))
    if mixtral not in weights and qwen not in weights and "missing" in missing:
        return missing["missing"]
    return weights[mixtral] if mixtral in weights else weights[qwen]


@torch.no_grad()
def calibrate(model) -> None:
    attns = [layer.self_attn for layer in model.model.layers]
    heads = model.config.num_key_value_heads
    for attn in attns:
        attn.kv_scales, attn.kv_amax = None, [torch.zeros(heads), torch.zeros(heads)]
    gen = torch.Generator().manual_seed(KV_CALIBRATION["seed"])
    ids = torch.randint(0, model.config.vocab_size, (KV_CALIBRATION["seqs"], KV_CALIBRATION["len"]), generator=gen)
    if model.config.bos_token_id is not None:
        ids[:, 0] = model.config.bos_token_id
    model(ids)
    for attn in attns:
        attn.kv_scales = [pow2_at_least(a, 112.0) for a in attn.kv_amax]
        attn.kv_amax = None


@torch.no_grad()
def greedy(model, prompt_ids: list[list[int]], max_new: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy generate per prompt: (new token ids, log-softmax of each step's logits). The logits
    come from one forward pass over the prompt and the generated tokens (every activation is quantized per token,
    so it computes what the cached steps compute), not from generate's cached steps: in transformers 5.24 a cached
    step can differ from the forward pass in the last bit of an activation, and an e4m3 rounding that flips there
    moved one logit of the tiny Llama by 0.31 (its third parity prompt, fifth step; Pagoda's matched the forward
    pass)."""
    results = []
    for ids in prompt_ids:
        ids_t = torch.tensor([ids])
        out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id)
        sequence = out.sequences[0]
        logits = model(sequence[None, :-1]).logits[0, len(ids) - 1:]
        results.append((sequence[len(ids):].tolist(), [torch.log_softmax(row.float(), -1) for row in logits]))
    return results


BLOCKS = {"fp8-block": (16, 32), "fp8-block128": (128, 128)}


def write_fp8_checkpoint(src: str, dst: str, fmt: str) -> tuple[str, dict, dict]:
    """An FP8 copy of the tiny checkpoint `src` in `dst`, routed experts included (routers and shared_expert_gate
    are not linears here: left as they are). fmt: "fp8-tensor" (transformers' fp8, a scale per tensor),
    "fp8-static" (AutoFP8's: a weight_scale per tensor, a static input_scale per linear), "fp8-block" (weight_block_size
    [16, 32]), "fp8-block128" ([128, 128], Qwen3-30B-A3B-FP8 / DeepSeek style),
    "ct-channel" (compressed-tensors, per-channel weights, dynamic per-token inputs) or "ct-static"
    (compressed-tensors, per-tensor weights and static input scales). Returns (dst, the dequantized weights and
    the static input scales the oracle uses)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, dequantized, input_scales = {}, {}, {}
    gen = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS + MLA_LINEARS + EXPERT_LINEARS):
            out[name] = t
            continue
        w = t.float()
        if fmt in BLOCKS:  # a partial block at the end of a dimension that is no multiple of it
            rows, cols = BLOCKS[fmt]
            padded = torch.zeros(-(-w.shape[0] // rows) * rows, -(-w.shape[1] // cols) * cols)
            padded[:w.shape[0], :w.shape[1]] = w.abs()
            amax = padded.unflatten(0, (-1, rows)).unflatten(2, (-1, cols)).amax(dim=(1, 3))
            scale = amax / 448
            full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:w.shape[0], :w.shape[1]]
        elif fmt in ("fp8-tensor", "fp8-static", "ct-static"):
            scale = w.abs().amax() / 448
            full = scale
        else:
            scale = w.abs().amax(dim=1, keepdim=True) / 448
            full = scale
        q = (w / full).clamp(-448, 448).to(E4M3)
        out[name] = q
        # AutoFP8's static checkpoints (quant_method fp8) name it weight_scale, as compressed-tensors does
        inv = fmt.startswith("fp8") and fmt != "fp8-static"
        out[f"{module}.{'weight_scale_inv' if inv else 'weight_scale'}"] = scale
        dequantized[module] = q.float() * full
        if fmt in ("ct-static", "fp8-static"):
            raw = (0.02 + 0.05 * torch.rand((), generator=gen)).reshape(1)  # a calibrated-looking scale
            out[f"{module}.input_scale"] = raw
            input_scales[module] = raw.item()
    save_file(out, os.path.join(dst, "model.safetensors"))
    _write_quantization_config(dst, fmt)
    return dst, dequantized, _group_static_scales(input_scales)


def _static_group(module: str) -> tuple[str, str]:
    """The projection whose one static input scale a checkpoint module's goes into: q / k / v one, gate / up one,
    and a MoE layer's routed experts one for all their gates and ups, one for all their downs."""
    prefix, name = module.rsplit(".", 1)
    if prefix.rsplit(".", 2)[-2:-1] == ["experts"]:  # ...experts.{e}.{projection}
        return prefix.rsplit(".", 1)[0], "w2" if name in ("w2", "down_proj") else "w13"
    groups = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    return prefix, groups.get(name, name)


def _group_static_scales(raw: dict) -> dict:
    """Pagoda's static input scale of each module: the largest of its group's (`_static_group`), rounded up to 2^k."""
    largest: dict = {}
    for module, value in raw.items():
        key = _static_group(module)
        largest[key] = max(largest.get(key, 0.0), value)
    return {m: pow2_at_least(torch.tensor(largest[_static_group(m)]), 1.0).item() for m in raw}


def _write_quantization_config(dst: str, fmt: str) -> None:
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    if fmt.startswith("fp8"):
        qc = {"quant_method": "fp8", "activation_scheme": "static" if fmt == "fp8-static" else "dynamic",
              "fmt": "e4m3"}
        if fmt in BLOCKS:
            qc["weight_block_size"] = list(BLOCKS[fmt])
    else:
        static = fmt == "ct-static"
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {
                  "targets": ["Linear"],
                  "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                              "strategy": "tensor" if static else "channel"},
                  "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                                        "strategy": "tensor" if static else "token"}}}}
    config["quantization_config"] = qc
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
