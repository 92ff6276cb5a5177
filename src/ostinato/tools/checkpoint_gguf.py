"""`ostinato make-checkpoint --format gguf`: random-weight GGUF files at the public shapes (tools/checkpoint.py).

Written with the `gguf` library's writer, tensor by tensor (memory stays at one tensor), under llama.cpp's names
and with its q/k row order. The types with a kernel (Q8_0, Q4_0, Q4_1 and the k-quants Q4_K, Q5_K, Q6_K) have
their blocks drawn directly (`random_blocks`): random codes under scales that give weights of the shape's
init_std, which is what a random checkpoint needs and what the kernels read. The library has no quantizer for
the k-quants, and drawing float32 weights to quantize them took minutes for an 8B Q8_0 file. The others (Q5_0,
Q5_1, BF16, F16) are drawn as float32 and quantized with the library's own functions.
"""

from __future__ import annotations

import numpy as np

# Byte offsets of each type's fp16 scales inside its block (gguf_linear's table of formats).
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# |code| * sub-block scale of a typical weight, per unit of d (so that d = std / this gives weights of ~std).
_CODE_SCALE = {"Q8_0": 64.0, "Q4_0": 4.0, "Q4_1": 8.0, "Q4_K": 8.0 * 32, "Q5_K": 16.0 * 32, "Q6_K": 16.0 * 64}


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """rows x k random weights of a GGUF type as raw blocks [rows, row_bytes] uint8: every code byte uniform, the
    fp16 scale d drawn around std / _CODE_SCALE so the weights have about that spread, and the offsets (Q4_1's m,
    the k-quants' dmin with each sub-block's min code equal to its scale code) centring them on zero: weights of
    one sign everywhere would make every projection nearly rank one, and greedy decoding repeat a token."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if k % block:
        raise ValueError(f"a {type_name} row holds a multiple of {block} weights, got {k}")
    b = rng.integers(0, 256, size=(rows, k // block, nbytes), dtype=np.uint8)
    scale = std / _CODE_SCALE[type_name]
    d = rng.uniform(0.5 * scale, 1.5 * scale, size=b.shape[:-1]).astype(np.float32)
    fields = {_F16_FIELDS[type_name][0]: d}
    if type_name == "Q6_K":  # int8 sub-block scales: keep them positive and moderate
        b[..., 192:208] = rng.integers(1, 64, size=(rows, k // block, 16), dtype=np.uint8)
    elif type_name == "Q4_1":
        fields[2] = -7.5 * d  # w = d * q + m, q in [0, 15]
    elif type_name in ("Q4_K", "Q5_K"):  # w = d * sc * q - dmin * mn: mn = sc and dmin = d * mean(q)
        b[..., 8:12] = b[..., 4:8]  # bytes 4..7 (the mins of sub-blocks 0-3, top bits of 4-7's) = bytes 0..3
        b[..., 12:16] = (b[..., 12:16] & 15) * 17  # sub-blocks 4-7: scale and min share one nibble value
        fields[2] = d * (7.5 if type_name == "Q4_K" else 15.5)
    for at, values in fields.items():
        b[..., at:at + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(rows, -1)


# --gguf-type: a mix (llama.cpp's _M recipes: more bits for attn_v and ffn_down in some layers, and for the
# output projection) or one type for every projection and the embedding.
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}
SINGLE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "F32")
GGUF_TYPES = (*MIXES, *SINGLE_TYPES)
# A k-quant needs rows of a multiple of 256 weights; llama.cpp's fallbacks where they are not.
_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third one between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(gguf_type: str, gguf_name: str, n_layers: int, k: int) -> str:
    """The type a tensor is stored in under --gguf-type; norms and biases stay F32."""
    if gguf_name.endswith("norm.weight") or gguf_name.endswith(".bias"):
        return "F32"
    if gguf_type in MIXES:
        base, more = MIXES[gguf_type]
        name = base
        if gguf_name == "output.weight":
            name = more
        elif gguf_name.endswith(("attn_v.weight", "ffn_down.weight")):
            name = more if _more_bits(int(gguf_name.split(".")[1]), n_layers) else base
    else:
        name = gguf_type
    return _K_FALLBACK[name] if name in _K_FALLBACK and k % 256 else name


def _tokenizer_fields(writer, vocab_size: int, family: str) -> None:
    """The make-checkpoint tokenizer as llama.cpp's "gpt2" (byte-level BPE) metadata, chat template included."""
    import json
    import tempfile
    from pathlib import Path

    from ostinato.tools.checkpoint_tokenizer import BEGIN_OF_TEXT, END_OF_TEXT, SPECIAL_TOKENS, write_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(tmp, vocab_size, family)
        model = json.loads((Path(tmp) / "tokenizer.json").read_text())["model"]
        config = json.loads((Path(tmp) / "tokenizer_config.json").read_text())
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])  # 3: control, 1: normal
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    writer.add_bos_token_id(model["vocab"][BEGIN_OF_TEXT])
    writer.add_eos_token_id(model["vocab"][END_OF_TEXT])
    writer.add_add_bos_token(bool(config["add_bos_token"]))
    writer.add_chat_template(config["chat_template"])


def _hparams(writer, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(1)  # informational only (llama.cpp's "mostly F16" code); readers use each tensor's type


def _rng(seed: int, name: str) -> np.random.Generator:
    """Each tensor's own generator: the file depends on the seed and the type alone."""
    import hashlib

    return np.random.default_rng(int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(),
                                                "little"))


def _draw(name: str, dims: tuple[int, ...], seed: int, std: float, final_gain: float) -> np.ndarray:
    rng = _rng(seed, name)
    if name.endswith("norm.weight"):
        gain = final_gain if name == "model.norm.weight" else 1.0
        return rng.uniform(0.5 * gain, 1.5 * gain, size=dims).astype(np.float32)
    return rng.normal(0.0, std, size=dims).astype(np.float32)


def _encode(values_or_none, type_name: str, dims, rng, std):
    """(bytes or values, raw dtype) for the writer: drawn blocks for the kernels' types, else the library's
    quantizer."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return values_or_none(), None
    if type_name in _CODE_SCALE:
        return random_blocks(type_name, int(np.prod(dims[:-1])), dims[-1], rng, std), qtype
    return quantize(values_or_none(), qtype), qtype


def write_gguf(path, config: dict, shapes: dict[str, tuple[int, ...]], family: str, gguf_type: str, seed: int,
               std: float, final_gain: float, progress: bool = False):
    """Write a random GGUF file: config's hyperparameters, the make-checkpoint tokenizer, and every tensor of
    `shapes` (HF names, tools/checkpoint.weight_shapes) under llama.cpp's name in its --gguf-type type.
    The tensors are written one at a time (add_tensor_info first, then the data): memory stays at one tensor."""
    import gguf
    from tqdm import tqdm

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    arch = GGUF_ARCH[family]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch)
    _hparams(writer, config)
    _tokenizer_fields(writer, config["vocab_size"], family)
    plan = []
    for hf_name, dims in shapes.items():
        base, _, leaf = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{leaf}"
        type_name = tensor_type(gguf_type, name, config["num_hidden_layers"], dims[-1])
        plan.append((hf_name, name, dims, type_name))
        qtype = gguf.GGMLQuantizationType[type_name]
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes_total = int(np.prod(dims)) * nbytes // block
        if type_name in ("F32", "F16"):
            writer.add_tensor_info(name, dims, np.dtype(np.float32 if type_name == "F32" else np.float16),
                                   nbytes_total)
        else:
            writer.add_tensor_info(name, gguf.quant_shape_to_byte_shape(dims, qtype), np.dtype(np.uint8),
                                   nbytes_total, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for hf_name, name, dims, type_name in tqdm(plan, desc="writing GGUF", unit="tensor", disable=not progress):
        rng = _rng(seed, f"blocks/{name}")

        def values(hf_name=hf_name, dims=dims):
            return _draw(hf_name, dims, seed, std, final_gain)

        data, _ = _encode(values, type_name, dims, rng, std)
        writer.write_tensor_data(data.astype(np.float16) if type_name == "F16" else data)
    writer.close()
    return path
