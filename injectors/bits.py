"""Bit-level corruption of tensors, in place, through an integer view of their storage."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

# (integer view dtype, sign bit, exponent bits, mantissa bits) per floating-point format
LAYOUT = {
    torch.float32: (torch.int32, 31, range(23, 31), range(0, 23)),
    torch.float64: (torch.int64, 63, range(52, 63), range(0, 52)),
    torch.float16: (torch.int16, 15, range(10, 15), range(0, 10)),
    torch.bfloat16: (torch.int16, 15, range(7, 15), range(0, 7)),
}
BIT_CLASSES = ("sign", "exponent", "mantissa", "random")


def choose_bits(dtype: torch.dtype, bit: int | str, nbits: int, rng: random.Random) -> list[int]:
    """``nbits`` distinct bit positions of ``dtype``: an explicit index, or drawn from a class of bits."""
    if dtype not in LAYOUT:
        raise ValueError(f"fault.target: tensors of dtype {dtype} cannot be bit-flipped (floating point only)")
    _, sign, exponent, mantissa = LAYOUT[dtype]
    width = sign + 1
    if isinstance(bit, int):
        if not 0 <= bit < width:
            raise ValueError(f"fault.bit={bit}: must be in [0, {width - 1}] for {dtype}")
        pool = [bit]
    else:
        pool = {"sign": [sign], "exponent": list(exponent), "mantissa": list(mantissa),
                "random": list(range(width))}[bit]
    if nbits > len(pool) and not isinstance(bit, int):
        raise ValueError(f"fault.bits={nbits}: a {bit} class of {dtype} has only {len(pool)} bits")
    return sorted(rng.sample(pool, min(nbits, len(pool))))


@dataclass(frozen=True)
class Flip:
    """What one flip did: the record that makes it reproducible."""

    index: int
    bits: list[int]
    old: float
    new: float


def flip_bits(tensor: torch.Tensor, index: int, bits: list[int]) -> Flip:
    """Flip ``bits`` of element ``index`` (flat) of ``tensor`` in place; works on CPU and CUDA tensors."""
    view_dtype = LAYOUT[tensor.dtype][0]
    flat = tensor.detach().view(-1)
    ints = flat.view(view_dtype)
    width = torch.iinfo(view_dtype).bits
    old = flat[index].item()
    value = int(ints[index].item()) & ((1 << width) - 1)
    for b in bits:
        value ^= 1 << b
    if value >= 1 << (width - 1):  # back to the signed range of the view
        value -= 1 << width
    ints[index] = value
    return Flip(index, bits, old, flat[index].item())


def pick_element(named: list[tuple[str, torch.Tensor]], rng: random.Random) -> tuple[str, torch.Tensor, int]:
    """An element drawn uniformly over all elements of the named tensors: (name, tensor, flat index)."""
    total = sum(t.numel() for _, t in named)
    k = rng.randrange(total)
    for name, t in named:
        if k < t.numel():
            return name, t, k
        k -= t.numel()
    raise AssertionError("unreachable")
