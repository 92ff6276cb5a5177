"""The decoder filled straight from a GGUF file, its projections kept in their GGUF blocks (kernels/gguf_linear.py).

The file is memory-mapped and read one tensor at a time, at the offsets model/gguf_native.py recorded, so host
memory holds the mapping's touched pages and one tensor in flight, never a float32 copy of the model.
    - qkv_proj, o_proj, gate_up_proj, down_proj whose types have a kernel (gguf_linear.KERNEL_TYPES) become
      GGUFLinear modules: raw rows on the device. The fused ones concatenate their shards' rows when the
      shards share a type, else (Q4_K_M mixes types per tensor) keep one kernel per run of shards of one type
      (GGUFConcat), which quantizes the activations once for all of them.
    - An untied lm_head whose type has a kernel (Q4_K_M's Q6_K, Q8_0's Q8_0) stays in its blocks too, as a
      QuantizedLMHead (model/layers.py): the largest projection, read whole each decode step.
    - Everything else (embedding, a tied lm_head, norms, projections of other types) is dequantized to the model
      dtype at load, and the log says which tensors and types.
llama.cpp stores llama q/k rows permuted for its RoPE; the rows are put back with transformers' own tensor
processor, the code the dequantizing path runs. The blocks are per row, so permuting byte rows is exact.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from ostinato.attention.base import AttentionBackend
from ostinato.config import ModelConfig
from ostinato.errors import CheckpointError, ConfigError
from ostinato.kernels.gguf_int8_route import int8_rows
from ostinato.kernels.gguf_linear import KERNEL_TYPES, GGUFConcat, GGUFLinear, dequantize_blocks
from ostinato.model.decoder import DecoderForCausalLM, fused_shards
from ostinato.model.layers import QuantizedLMHead
from ostinato.model.gguf_native import native_marker, tensor_table
from ostinato.model.loader import materialize
from ostinato.model.parallel import TPGroup

logger = logging.getLogger(__name__)

F32, F16 = 0, 1
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
IGNORED = ("rope_freqs.weight",)  # llama3 RoPE factors: config.json's rope_scaling carries them
DENSE_ROWS = 4096  # rows dequantized at a time into a dense parameter


class GGUFTensors:
    """Tensors of one GGUF file by HF name, read from the memory map on demand, q/k rows in HF's order."""

    def __init__(self, model_dir: Path, config: ModelConfig):
        import gguf
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        marker = native_marker(model_dir)
        self.path = Path(marker["gguf_file"])
        if not self.path.is_file():
            raise CheckpointError(f"{model_dir} reads its weights from {self.path}, which is no longer there; "
                                  "pass the .gguf file again")
        self.table = tensor_table(model_dir)
        self.map = np.memmap(self.path, dtype=np.uint8, mode="r")
        arch = marker["architecture"]
        self.names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_layers)
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config={
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads})
        self.used: set[str] = set()

    def gguf_name(self, hf_name: str) -> str | None:
        base, _, leaf = hf_name.rpartition(".")
        name = self.names.get_name(base)
        return None if name is None else f"{name}.{leaf}"

    def qtype(self, hf_name: str) -> int | None:
        name = self.gguf_name(hf_name)
        return self.table[name][0] if name in self.table else None

    def raw(self, hf_name: str) -> np.ndarray:
        """The tensor as stored, rows in HF's order: [rows, row_bytes] uint8 for a block type, else its values."""
        from gguf.quants import quant_shape_to_byte_shape

        name = self.gguf_name(hf_name)
        if name not in self.table:
            raise CheckpointError(f"{self.path.name} has no tensor for {hf_name} (GGUF name {name}); the file "
                                  "is incomplete or config.json does not match it")
        self.used.add(name)
        qtype, ne, offset, nbytes = self.table[name]
        data = self.map[offset:offset + nbytes]
        dims = tuple(reversed(ne))
        if qtype in (F32, F16):
            data = data.view(np.float32 if qtype == F32 else np.float16).reshape(dims)
        else:
            data = data.reshape(quant_shape_to_byte_shape(dims, qtype))
        return np.ascontiguousarray(self.processor.process(data, name=name).weights)

    def dense(self, hf_name: str, device: torch.device) -> torch.Tensor:
        """The tensor's values in float32 on `device` (block types with a kernel dequantized there)."""
        raw = self.raw(hf_name)
        return self._values(raw, self.qtype(hf_name), self.table[self.gguf_name(hf_name)][1][0], device)

    def copy_into(self, hf_name: str, dest: torch.Tensor) -> None:
        """dest.copy_(the tensor's values), dequantized DENSE_ROWS rows at a time: no float32 copy of a whole
        embedding (2 GB at the 8B's vocabulary) is ever made."""
        raw, qtype = self.raw(hf_name), self.qtype(hf_name)
        ne = self.table[self.gguf_name(hf_name)][1]
        if tuple(reversed(ne)) != tuple(dest.shape):
            raise CheckpointError(f"{self.path.name}: {hf_name} has shape {tuple(reversed(ne))}, the model built "
                                  f"from its metadata expects {tuple(dest.shape)}")
        k = ne[0]
        for start in range(0, raw.shape[0], DENSE_ROWS):
            part = self._values(raw[start:start + DENSE_ROWS], qtype, k, dest.device)
            dest[start:start + DENSE_ROWS].copy_(part.view(dest[start:start + DENSE_ROWS].shape))

    @staticmethod
    def _values(raw: np.ndarray, qtype: int, k: int, device: torch.device) -> torch.Tensor:
        import gguf.quants

        if qtype in (F32, F16):
            return torch.from_numpy(raw.astype(np.float32)).to(device)
        if qtype in KERNEL_TYPES:
            return dequantize_blocks(_to_device(raw, device), qtype, k)
        return torch.from_numpy(gguf.quants.dequantize(raw, qtype)).to(device)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # A copy of the mapped bytes: the tensor must own writable memory whether or not the device is the host.
    return torch.from_numpy(np.array(array)).to(device)


def _shards(model_config: ModelConfig, prefix: str, proj: str) -> list[str]:
    """HF weight names that make up projection `proj` (e.g. self_attn.qkv_proj) of the layer at `prefix`."""
    parent, _, fused = proj.rpartition(".")
    parts = [hf for hf, (f, _, _) in fused_shards(model_config).items() if f == fused]
    return [f"{prefix}{parent}.{p}.weight" for p in (parts or [fused])]


def _quantized_projection(tensors: GGUFTensors, names: list[str], in_features: int, device: torch.device,
                          dtype: torch.dtype) -> GGUFLinear | GGUFConcat | None:
    """The projection kept in its blocks, or None where a shard's type has no kernel (it is then dequantized)."""
    types = [tensors.qtype(n) for n in names]
    if any(t not in KERNEL_TYPES for t in types):
        return None
    biases = [tensors.dense(n.removesuffix("weight") + "bias", device).to(dtype)
              if tensors.qtype(n.removesuffix("weight") + "bias") is not None else None for n in names]
    # Consecutive shards of one type share a kernel (q|k of Q4_K_M's q, k Q4_K and v Q6_K): one launch fewer.
    runs = [list(run) for _, run in itertools.groupby(zip(types, names, biases), key=lambda shard: shard[0])]
    linears = [_one_type_linear(run, tensors, in_features, device) for run in runs]
    if len(linears) == 1:
        return linears[0]
    logger.info("%s: shards of types %s, one kernel each", names[0].rsplit(".", 2)[0],
                "/".join(KERNEL_TYPES[run[0][0]][0] for run in runs))
    return GGUFConcat(linears)


def _one_type_linear(run: list, tensors: GGUFTensors, in_features: int, device: torch.device) -> GGUFLinear:
    """Shards (type, name, bias) of one type as one GGUFLinear: their block rows concatenated."""
    qtype, names, biases = run[0][0], [name for _, name, _ in run], [bias for _, _, bias in run]
    blocks = np.concatenate([tensors.raw(n) for n in names]) if len(names) > 1 else tensors.raw(names[0])
    bias = None if biases[0] is None else torch.cat(biases)
    return GGUFLinear(qtype, _to_device(blocks, device), in_features, bias)


def _replace_projections(model: DecoderForCausalLM, tensors: GGUFTensors, device, dtype) -> Counter:
    """Swap every projection whose shards all have a kernel for its quantized module; count types kept."""
    kept: Counter = Counter()
    for i, layer in enumerate(model.model.layers):
        for proj in PROJECTIONS:
            parent_path, _, attr = proj.rpartition(".")
            parent = layer.get_submodule(parent_path)
            names = _shards(model.config, f"model.layers.{i}.", proj)
            module = _quantized_projection(tensors, names, getattr(parent, attr).in_features, device, dtype)
            if module is not None:
                setattr(parent, attr, module)
                kept.update(KERNEL_TYPES[tensors.qtype(n)][0] for n in names)
    return kept


def _replace_head(model: DecoderForCausalLM, tensors: GGUFTensors, device) -> Counter:
    """The untied lm_head kept in its blocks where its type has a kernel (QuantizedLMHead); its type counted."""
    qtype = tensors.qtype("lm_head.weight")
    if model.tied or qtype not in KERNEL_TYPES:
        return Counter()
    head = GGUFLinear(qtype, _to_device(tensors.raw("lm_head.weight"), device), model.config.hidden_size)
    model.lm_head = QuantizedLMHead(head, model.config.vocab_size)
    return Counter({KERNEL_TYPES[qtype][0]: 1})


def _fill_dense(model: DecoderForCausalLM, tensors: GGUFTensors) -> Counter:
    """Every remaining parameter, dequantized into place (fused ones by row slice); counts the types."""
    rows = fused_shards(model.config)
    dequantized: Counter = Counter()
    for name, param in model.named_parameters():  # a tied lm_head is deduplicated away here
        module_path, _, leaf = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        parts = [(f"{parent}.{hf}.{leaf}", start, n) for hf, (f, start, n) in rows.items() if f == module]
        for hf_name, start, n in parts or [(name, 0, param.shape[0])]:
            tensors.copy_into(hf_name, param[start:start + n] if parts else param)
            qtype = tensors.qtype(hf_name)
            if qtype not in (F32, F16):
                dequantized[qtype] += 1
    return dequantized


def load_gguf_model(model_dir: Path, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                    backend: AttentionBackend, tp: TPGroup) -> DecoderForCausalLM:
    """Build the decoder from a GGUF metadata folder (model/gguf_native.py) and the file it names."""
    import gguf

    if tp.world_size > 1:
        raise ConfigError("GGUF blocks are not split across GPUs: pass --gguf-dequantize to run a GGUF file "
                          "with --tensor-parallel-size > 1")
    t0 = time.perf_counter()
    tensors = GGUFTensors(model_dir, model_config)
    with torch.device("meta"):
        model = DecoderForCausalLM(model_config, backend, tp)
    if tensors.gguf_name("lm_head.weight") not in tensors.table and not model.tied:
        logger.info("%s has no output.weight: tying the output projection to the embedding", tensors.path.name)
        model.tie_weights()
    with torch.no_grad():
        kept = _replace_projections(model, tensors, device, dtype) + _replace_head(model, tensors, device)
        materialize(model, device, dtype)
        model.model.rotary_emb.rebuild(device, dtype)
        dequantized = _fill_dense(model, tensors)
    unused = sorted(set(tensors.table) - tensors.used - set(IGNORED)
                    - ({tensors.gguf_name("lm_head.weight")} if model.tied else set()))
    if unused:
        raise CheckpointError(f"{tensors.path.name}: {len(unused)} tensor(s) have no place in the "
                              f"{model_config.family} decoder, e.g. {', '.join(unused[:5])}")
    names = {int(t): t.name for t in gguf.GGMLQuantizationType}
    logger.info("GGUF %s read in %.1f s: projections kept quantized (%s); dequantized to %s at load: %s",
                tensors.path.name, time.perf_counter() - t0,
                ", ".join(f"{n} x {t}" for t, n in kept.most_common()) or "none", str(dtype).removeprefix("torch."),
                ", ".join(f"{n} x {names[t]}" for t, n in dequantized.most_common()) or "nothing but norms")
    line = int8_dot_line(kept, device, dtype)
    if line:
        logger.info(line)
    return model.eval()


def int8_dot_line(kept: Counter, device: torch.device, dtype: torch.dtype) -> str | None:
    """The start-up log's word on the one approximation the GGUF path adds (kernels/gguf_int8_dot.py), when it
    applies: projections of those types kept, on CUDA, in 16-bit activations."""
    by_rows: dict[tuple[int, int], list[str]] = {}
    for qtype in sorted(KERNEL_TYPES):
        rows = int8_rows(qtype)
        if rows is not None and KERNEL_TYPES[qtype][0] in kept:
            by_rows.setdefault(rows, []).append(KERNEL_TYPES[qtype][0])
    if not by_rows or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    steps = "; ".join(f"{' and '.join(types)} at {first}-{last} rows" for (first, last), types in by_rows.items())
    return (f"decode steps multiply these projections as int8 dot products ({steps}): their input rounded to "
            "int8 per 32 values, as llama.cpp's mat-vec and MMQ kernels (kernels/gguf_int8_route.py)")
