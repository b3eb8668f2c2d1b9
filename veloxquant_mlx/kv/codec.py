"""How the serving KV path stores keys and values: the model's float type, or quantized.

``--kv-format int8|int4`` stores K and V with MLX's group-wise affine quantization
(``mx.quantize``: each group of ``group_size`` values along the head dimension becomes
``bits``-bit codes with a scale and a bias in the model's float type), written once when a
token is appended and read by attention through ``mx.quantized_matmul`` (mlx_lm's quantized
attention): no dequantized copy of the context is made. A stored span is a tuple of arrays
with the token axis at dimension 2: ``(values,)`` for a float format, ``(codes, scales,
biases)`` for a quantized one, so slicing, joining and copying spans is the same for both.

Bytes per token and head: ``head_dim * itemsize`` in the float type; ``head_dim * bits / 8 +
2 * (head_dim / group_size) * itemsize`` quantized. A Llama head (128 wide) in bf16: 256 bytes,
int8 (group 64) 136 (1.88x the tokens in the same memory), int4 72 (3.56x).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

FORMATS = ("auto", "fp16", "bf16", "fp32", "int8", "int4")
_FLOAT_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
_BITS = {"int8": 8, "int4": 4}
GROUP_SIZES = (32, 64)

Stored = tuple[mx.array, ...]  # a span of one stream: (values,) or (codes, scales, biases)


@dataclass(frozen=True, slots=True)
class KVCodec:
    """One KV storage format.

    Attributes:
        name: "bfloat16", "float16", "float32" (the model's float type) or "int8" / "int4".
        dtype: The model's float type: what K and V arrive in and what a read decodes to.
        bits: Bits per quantized value; None for a float format.
        group_size: Values per scale and bias (quantized formats).
    """

    name: str
    dtype: mx.Dtype
    bits: int | None = None
    group_size: int = 64

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def bytes_per_head_token(self, head_dim: int) -> int:
        """Bytes one token of one KV head takes in one stream (K or V) of one layer."""
        if self.bits is None:
            return head_dim * self.dtype.size
        return head_dim * self.bits // 8 + 2 * (head_dim // self.group_size) * self.dtype.size

    def encode(self, x: mx.array) -> Stored:
        """``x`` [..., T, D] in the float type, as stored."""
        if self.bits is None:
            return (x,)
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, parts: Stored) -> mx.array:
        """A stored span back in the float type (prefill reads cached pages this way)."""
        if self.bits is None:
            return parts[0]
        codes, scales, biases = parts
        return mx.dequantize(codes, scales, biases, group_size=self.group_size, bits=self.bits)


def parse(requested: str, model_dtype: str, head_dim: int, group_size: int | None) -> KVCodec:
    """The codec ``--kv-format`` and ``--kv-group-size`` ask for, for a model whose KV is
    ``model_dtype`` ("bfloat16", ...) with heads ``head_dim`` wide.

    ``auto`` is the model's float type. A float format other than the model's is refused (the
    attention would read a converted copy of the whole context every step); so is a group
    size that does not divide ``head_dim``. ``group_size`` None: 64 where it divides
    ``head_dim``, else 32.

    Raises:
        ValueError: One line naming the flag and what would work.
    """
    dtype = getattr(mx, model_dtype)
    if requested not in FORMATS:
        raise ValueError(f"--kv-format must be one of {', '.join(FORMATS)}, got {requested!r}")
    if requested == "auto" or _FLOAT_NAMES.get(requested) == model_dtype:
        return KVCodec(model_dtype, dtype)
    if requested in _FLOAT_NAMES:
        raise ValueError(
            f"--kv-format {requested}: this model's KV is {model_dtype}; a float format other "
            "than the model's is not supported (use auto, int8 or int4)"
        )
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"--kv-group-size must be 32 or 64, got {group_size}")
    size = group_size or (64 if head_dim % 64 == 0 else 32)
    if head_dim % size:
        raise ValueError(
            f"--kv-format {requested}: the model's head_dim {head_dim} is not a multiple of the "
            f"group size {size}; this model's KV cannot be stored in {requested}"
        )
    return KVCodec(requested, dtype, _BITS[requested], size)


def slice_span(parts: Stored, start: int, end: int) -> Stored:
    """Positions ``start:end`` of a stored span (views)."""
    return tuple(p[:, :, start:end] for p in parts)


def join_spans(spans: list[Stored]) -> Stored:
    """Stored spans one after the other along the token axis."""
    if len(spans) == 1:
        return spans[0]
    return tuple(mx.concatenate(list(ps), axis=2) for ps in zip(*spans, strict=True))


def copy_span(parts: Stored) -> Stored:
    """A stored span in its own memory (a cached page must not pin a working set)."""
    return tuple(mx.contiguous(p) for p in parts)
