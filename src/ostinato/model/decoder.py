"""One decoder for the Llama / Mistral / Qwen2 / Qwen3 families, driven by `ModelConfig`.

The families differ only in details the config carries: GQA head counts, q/k/v bias (Qwen2), per-head
q/k RMSNorm before RoPE (Qwen3), tied embeddings, llama3 RoPE scaling. Parameter names follow HF's
(`model.layers.0.self_attn.o_proj.weight`, ...) except two fused projections, which save kernels:
`qkv_proj` (rows q | k | v) and `gate_up_proj` (rows gate | up); `fused_shards` says where each HF
tensor goes. Tokens of all sequences are flattened into one [num_tokens] batch; the attention backend
separates them through AttentionMetadata.

The steps between the GEMMs (norms with the residual add, q/k norm + RoPE, SiLU-and-mul) go through a
`DecoderKernels` picked once at bind time: fused Triton kernels on CUDA, plain torch elsewhere
(kernels/fused.py). On the GPU a decode layer is then at most 9 kernels: 4 GEMMs, 3 fused (two norms,
SiLU-and-mul) and one attention kernel that also does the q/k norm, RoPE and K/V write (decode_with_rope);
where the small-batch GEMV takes qkv_proj or gate_up_proj (a few rows), the norm before it rides in its
kernel, down to 6 a layer at batch 1, and 5 where the activation folds into gate_up's kernel too (up to 16
rows: gemv.choose_glu_fold). FP8 weights at 1-3 rows (kernels/fp8_linear.py) take the norms from the other
side: o_proj's and down_proj's kernels compute the norm after them (DecoderKernels.linear_then_norm), so the
layer passes each projection the norm that follows it (NormAfter) and the next one gets it done (Normed). A
prefill layer is 10 (the q/k norm + RoPE kernel writes K/V, then attention). The torch ops take 13 (Llama) to 16
(Qwen3) plus the backend's KV write and attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.attention.base import AttentionBackend, AttentionMetadata
from ostinato.config import ModelConfig
from ostinato.errors import ConfigError
from ostinato.kernels.decoder_kernels import Normed, NormAfter
from ostinato.kernels.fused import TORCH_KERNELS, DecoderKernels, kernels_for
from ostinato.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from ostinato.model.parallel import (SINGLE_RANK, RowParallelLinear, TPGroup, VocabParallelEmbedding,
                                     VocabParallelLMHead, local_heads)

OProj = Callable[[torch.Tensor, nn.Module], "torch.Tensor | Normed"]  # (heads' output, o_proj) -> o_proj's output


def projection_biases(config: ModelConfig) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) as HF's modeling code decides them for each family."""
    if config.family == "qwen2":
        return True, False  # Qwen2 hard-codes bias on q/k/v, none on o_proj
    if config.family == "mistral":
        return False, False
    return config.attention_bias, config.attention_bias  # llama, qwen3: one flag for all four


def fused_shards(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF projection name -> (fused module name, first row, number of rows) in the fused weight/bias."""
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return {
        "q_proj": ("qkv_proj", 0, q_rows),
        "k_proj": ("qkv_proj", q_rows, kv_rows),
        "v_proj": ("qkv_proj", q_rows + kv_rows, kv_rows),
        "gate_proj": ("gate_up_proj", 0, inter),
        "up_proj": ("gate_up_proj", inter, inter),
    }


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache; the cache itself belongs to the runner.

    Under tensor parallelism (model/parallel.py) a rank holds its own query and KV heads: num_heads and
    num_kv_heads are this rank's, qkv_proj is column-parallel and o_proj row-parallel."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE_RANK):
        super().__init__()
        self.num_heads, self.num_kv_heads = local_heads(config, tp.world_size)
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.backend = backend
        qkv_bias, o_bias = projection_biases(config)
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_rows, bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.num_heads * config.head_dim, config.hidden_size, o_bias, tp)
        self.qk_norm = config.qk_norm
        self.norm_eps = config.rms_norm_eps
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        # Set by DecoderForCausalLM.bind_kv_caches; plain attributes so they stay out of state_dict.
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.v_cache: torch.Tensor | None = None

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor,
                meta: AttentionMetadata, kernels: DecoderKernels,
                project: OProj | None = None) -> torch.Tensor | Normed:
        """qkv [T, (H + 2Hkv) * D]: qkv_proj of the normalised hidden states (the layer runs it, so that the norm
        can fold into it) -> attention output after o_proj [T, hidden].
        rope_cache: the model's [max_positions, 2 * head_dim] cos | signed-sin table. project: computes o_proj
        from the heads' output (the layer's, so that the norm after o_proj can ride in its kernel), by default
        kernels.linear."""
        project = project if project is not None else kernels.linear
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("call DecoderForCausalLM.bind_kv_caches() before forward()")
        num_tokens = qkv.shape[0]
        h, kv = self.num_heads, self.num_kv_heads
        heads = qkv.view(num_tokens, h + 2 * kv, self.head_dim)  # [T, H+2Hkv, D]
        q_weight, k_weight = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        norm_rope = (heads, q_weight, k_weight, rope_cache, positions, h, kv, self.norm_eps)
        # Fused K/V writes: decided by the kernel set and the backend (static attributes, before capture).
        fused_write = kernels.qk_norm_rope_write_kv is not None and self.backend.accepts_fused_kv_write
        if fused_write and not meta.is_prefill and self.backend.decode_applies_rope:
            # Decode in one kernel: (Qwen3: per-head RMSNorm, then) RoPE, the K/V write and attention; and where
            # o_proj reads its input quantized to int8, that too (then `out` is unwritten: its shape and dtype
            # stand for o_proj's input).
            qx = self._o_proj_int8_input(heads, kernels)
            out = self.backend.decode_with_rope(heads, q_weight, k_weight, rope_cache, positions, self.norm_eps,
                                                self.k_cache, self.v_cache, meta, self.scale, qx)  # [T, H, D]
            out = out.reshape(num_tokens, h * self.head_dim)
            if qx is not None:
                return kernels.int8_input_linear(qx, out, self.o_proj)
            return project(out, self.o_proj)
        if fused_write:
            # One kernel: (Qwen3: per-head RMSNorm, then) RoPE; k and v go straight to their cache slots.
            q = kernels.qk_norm_rope_write_kv(*norm_rope, self.k_cache, self.v_cache, meta.slot_mapping)  # [T, H, D]
        else:
            # (Qwen3: per-head RMSNorm, then) RoPE on q and k together: [T, H + Hkv, D], a new tensor.
            qk = kernels.qk_norm_rope(*norm_rope)
            q, k, v = qk[:, :h], qk[:, h:], heads[:, h + kv:]  # views: [T, H, D], [T, Hkv, D], [T, Hkv, D]
            self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale)  # [T, H, D]
        return project(out.reshape(num_tokens, h * self.head_dim), self.o_proj)

    def _o_proj_int8_input(self, heads: torch.Tensor, kernels: DecoderKernels):
        """Room for o_proj's input quantized to int8 where o_proj reads it so and the decode kernel can write it
        (kernels/gguf_int8_dot.QuantizedX), else None. heads: the qkv projection [T, H + 2Hkv, D]."""
        if kernels.int8_input is None or not self.backend.decode_quantizes_output(self.head_dim):
            return None
        h = self.num_heads
        return kernels.int8_input(heads[:, :h].reshape(heads.shape[0], h * self.head_dim), self.o_proj)


class DecoderLayer(nn.Module):
    """Pre-norm block, with the residual stream carried between layers as vLLM does:

        residual = residual + x;  qkv = qkv_proj(norm(residual))    (one kernel at decode batches)
        x = attn(qkv)
        residual = residual + x;  gate_up = gate_up_proj(norm(residual))
        x = down_proj(silu(gate) * up)                         -> (x, residual) to the next layer

    which is HF's x + attn(norm(x)), then x + mlp(norm(x)), with each residual add moved into the
    following norm's kernel, and each norm into the projection after it where the kernel set can
    (DecoderKernels.norm_then_linear). The first layer gets residual=None: its input is the residual.
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE_RANK):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        inter = config.intermediate_size // tp.world_size  # gate_up column-parallel, down row-parallel
        self.mlp = SwiGLUMLP(config.hidden_size, inter,
                             down_proj=RowParallelLinear(inter, config.hidden_size, False, tp))

    def forward(self, hidden: torch.Tensor | Normed, residual: torch.Tensor | None, positions: torch.Tensor,
                rope_cache: torch.Tensor, meta: AttentionMetadata, kernels: DecoderKernels,
                after: NormAfter | None = None) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        """hidden, residual: [T, hidden] -> (mlp output, residual stream before it), both [T, hidden]. after: the
        norm after this layer (the next one's input norm, or the final norm); where down_proj's kernel computes
        it (DecoderKernels.linear_then_norm) the output is Normed, with the residual stream after the MLP. hidden
        may be Normed so, by the layer before."""
        norm, attn, mlp = self.input_layernorm, self.self_attn, self.mlp
        qkv, residual = kernels.norm_then_linear(hidden, residual, norm.weight, norm.eps, attn.qkv_proj)
        norm = self.post_attention_layernorm
        post_norm = NormAfter(norm.weight, norm.eps, mlp.gate_up_proj)
        hidden = attn(qkv, positions, rope_cache, meta, kernels,
                      lambda x, o_proj: kernels.linear_then_norm(x, o_proj, residual, post_norm))
        return kernels.norm_then_mlp(hidden, residual, norm.weight, norm.eps, mlp.gate_up_proj, mlp.down_proj,
                                     after)


class DecoderModel(nn.Module):
    """Embedding, the layer stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE_RANK):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)

    def norm_after(self, i: int) -> NormAfter:
        """The norm after layer i, the next layer's input norm or the final one, and the projection it feeds."""
        if i + 1 < len(self.layers):
            following = self.layers[i + 1]
            norm = following.input_layernorm
            return NormAfter(norm.weight, norm.eps, following.self_attn.qkv_proj)
        return NormAfter(self.norm.weight, self.norm.eps, None)


class DecoderForCausalLM(nn.Module):
    """The model the runner drives: forward() to final hidden states, compute_logits() for sampled rows.

    `tp` places this instance in a tensor-parallel group (model/parallel.py): it then holds its rank's part
    of every split weight, and forward / compute_logits return the same full result on every rank."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE_RANK):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, backend, tp)
        self.lm_head = VocabParallelLMHead(config.hidden_size, config.vocab_size, tp)
        if config.tie_word_embeddings:
            self.tie_weights()
        # Test hook: force a host sync inside forward so CUDA-graph capture must fail loudly.
        self.debug_host_sync = False
        # Norm / activation / RoPE implementations; bind_kv_caches picks them for the caches' device.
        self.kernels: DecoderKernels = TORCH_KERNELS
        for param in self.parameters():
            param.requires_grad_(False)

    def tie_weights(self) -> None:
        """Share the input embedding as the output projection (one tensor, counted once)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    def bind_kv_caches(self, caches: list[tuple[torch.Tensor, torch.Tensor]],
                       kernels: DecoderKernels | None = None) -> None:
        """One (k_cache, v_cache) per layer, each [num_blocks, block_size, num_kv_heads, head_dim].

        Also picks the norm / activation / RoPE kernels, once: `kernels`, or by default the fused Triton
        ones when the caches are on CUDA and triton is importable (launched with PDL when the attention
        backend's `pdl` says so: one launch policy for every kernel of the step), the torch ones otherwise.
        """
        if len(caches) != len(self.model.layers):
            raise ValueError(f"got {len(caches)} KV caches for {len(self.model.layers)} layers")
        for layer, (k_cache, v_cache) in zip(self.model.layers, caches):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k_cache, v_cache
        backend = self.model.layers[0].self_attn.backend if len(self.model.layers) else None
        pdl = backend.pdl if backend is not None else False
        invariant = backend.batch_invariant if backend is not None else False
        self.kernels = kernels if kernels is not None else kernels_for(caches[0][0].device, pdl, invariant)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> final hidden states [num_tokens, hidden_size]."""
        kernels = self.kernels
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.debug_host_sync:
            hidden.sum().item()  # deliberate device->host sync; illegal while capturing a CUDA graph
        rope_cache = self.model.rotary_emb.cos_sin_cache  # [max_positions, 2 * head_dim], shared by all layers
        residual = None
        for i, layer in enumerate(self.model.layers):
            after = self.model.norm_after(i)
            hidden, residual = layer(hidden, residual, positions, rope_cache, meta, kernels, after)
        norm = self.model.norm
        return kernels.final_norm(hidden, residual, norm.weight, norm.eps)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size], float32 unless float32=False (model dtype).

        Float32 logits come straight from the GEMM: 16-bit operands, float32 accumulation and output
        (torch.mm's out_dtype on CUDA), never rounded to 16 bits. bf16 logits step by 0.125 near 16, so
        two candidate tokens often tie exactly and greedy then picks by index; rounding first and
        upcasting after cannot undo that. Measured at M=1: as fast as the bf16 GEMM (docs/PERFORMANCE.md,
        "Why these defaults")."""
        weight = self.lm_head.weight  # [vocab (this rank's rows under tensor parallelism), hidden]
        if weight is None:  # the head kept quantized (QuantizedLMHead)
            if float32 and self.kernels.logits is not None:
                raise ConfigError("--batch-invariant supports unquantized checkpoints only: this model's output "
                                  "projection is kept quantized; drop --batch-invariant or load a bf16/fp16/fp32 "
                                  "checkpoint")
            return self.lm_head.logits(hidden, float32)
        if float32 and self.kernels.logits is not None:  # the set's own (batch invariant): one rank, no assemble
            return self.kernels.logits(hidden, weight)
        if not float32 or hidden.dtype == torch.float32:
            logits = self.lm_head(hidden)
            return logits.float() if float32 else logits
        if hidden.is_cuda:
            local = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        else:  # CPU has no mixed-dtype mm: upcast (16-bit values are exact in float32; a transient copy)
            local = F.linear(hidden.float(), weight.float())
        return self.lm_head.assemble(local)  # the other ranks' rows, under tensor parallelism
