"""A synthetic Llama-shaped training state of a chosen size, for benchmarks and tests.

The shapes follow Llama: token embedding and LM head (vocab x hidden), per layer the attention
projections q/k/v/o (hidden x hidden), the MLP gate/up (intermediate x hidden) and down
(hidden x intermediate) with intermediate = 8/3 hidden, and RMSNorm weights (hidden). Weights are
bf16; with ``optim=True`` every weight also has fp32 Adam ``exp_avg``/``exp_avg_sq`` and an fp32
master copy, as mixed-precision training keeps them. The hidden size and layer count are picked
so the whole state is close to the requested number of bytes, keeping layers ~ hidden/128 deep.

Keys are flat (``model.layers.3.mlp.up_proj.weight``, ``optim.exp_avg.model.norm.weight``) so
that every format under test (DCP, torch.save, safetensors) stores the same dictionary.
Multi-rank runs shard every tensor by rows (dim 0), the way DTensor ``Shard(0)`` splits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dcp_nvme.errors import InvalidInputError
from dcp_nvme.humanize import format_size

_MULTIPLE = 64
_MAX_VOCAB = 32000
_EMBED_SHARE = 0.1
"""Fraction of the parameters first given to each of embedding and LM head (before fill-up)."""
_POOL = 1 << 22
"""Random values drawn per dtype and rank, then tiled into the tensors."""


@dataclass(frozen=True)
class TensorSpec:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ModelSpec:
    """The dimensions chosen for a target size, and every tensor of the state."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    optim: bool
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors if not t.fqn.startswith("optim."))

    def describe(self) -> str:
        what = "bf16 weights + fp32 Adam moments and master weights" if self.optim else "bf16 weights"
        return (f"Llama-shaped: {self.layers} layers, hidden {self.hidden}, MLP {self.intermediate}, "
                f"vocab {self.vocab}; {self.params / 1e6:.1f} M params, {what}; "
                f"{len(self.tensors)} tensors, {format_size(self.nbytes)}")


def _round(value: float, multiple: int = _MULTIPLE) -> int:
    return max(multiple, int(value) // multiple * multiple)


def _weights(hidden: int, intermediate: int, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    h, i = hidden, intermediate
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        names += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (h, h)),
            (f"{p}.self_attn.v_proj.weight", (h, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (i, h)),
            (f"{p}.mlp.up_proj.weight", (i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
        ]
    names += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return names


def llama_spec(nbytes: int, optim: bool = False) -> ModelSpec:
    """The Llama-shaped state closest to ``nbytes`` in total (a few % either way)."""
    if nbytes < 1 << 20:
        raise InvalidInputError(f"a synthetic state needs at least 1 MiB, got {nbytes} bytes")
    per_param = 2 + (12 if optim else 0)  # bf16 weight (+ fp32 exp_avg, exp_avg_sq, master)
    params = nbytes / per_param
    chosen = None
    for hidden in range(8192, _MULTIPLE - 1, -_MULTIPLE):
        intermediate = -(-(8 * hidden // 3) // _MULTIPLE) * _MULTIPLE
        per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
        vocab = min(_MAX_VOCAB, _round(_EMBED_SHARE * params / hidden))
        body = params - 2 * vocab * hidden - hidden
        wanted_layers = max(2, hidden // 128)
        if body >= wanted_layers * per_layer or hidden == _MULTIPLE:
            layers = max(1, int(body // per_layer))
            # the vocabulary absorbs what whole layers leave over, so the size comes out close
            leftover = params - layers * per_layer - hidden
            vocab = _round(leftover / (2 * hidden))
            chosen = (hidden, intermediate, layers, vocab)
            break
    assert chosen is not None
    hidden, intermediate, layers, vocab = chosen
    tensors = [TensorSpec(fqn, shape, torch.bfloat16) for fqn, shape in _weights(*chosen)]
    if optim:
        weights = list(tensors)
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            tensors += [TensorSpec(f"optim.{kind}.{w.fqn}", w.shape, torch.float32) for w in weights]
    return ModelSpec(hidden, intermediate, layers, vocab, optim, tuple(tensors))


def shard_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, length)`` of a rank's rows, split like ``torch.chunk`` (DTensor ``Shard(0)``)."""
    per = -(-rows // world_size)
    start = min(rows, rank * per)
    return start, min(per, rows - start)


def local_shape(spec: TensorSpec, rank: int, world_size: int) -> tuple[int, ...]:
    _, length = shard_rows(spec.shape[0], rank, world_size)
    return (length, *spec.shape[1:])


def build_state(spec: ModelSpec, rank: int = 0, world_size: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """This rank's row shard of every tensor, each in its own storage like a real model's.

    Values come from a small pool of normal(0, 0.02) numbers per dtype, generated from ``seed``
    and the rank, tiled from a different offset in every tensor: reproducible, no two tensors
    alike, and fast (drawing gigabytes of random numbers took longer than the benchmark).
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    pools: dict[torch.dtype, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for tensor in spec.tensors:
        value = torch.empty(local_shape(tensor, rank, world_size), dtype=tensor.dtype)
        if tensor.dtype not in pools:
            pools[tensor.dtype] = torch.empty(_POOL, dtype=torch.float32).normal_(
                0.0, 0.02, generator=generator).to(tensor.dtype)
        pool = pools[tensor.dtype]
        flat = value.view(-1)
        start = int(torch.randint(0, _POOL, (1,), generator=generator))
        done = 0
        while done < flat.numel():
            take = min(flat.numel() - done, _POOL - start)
            flat[done : done + take].copy_(pool[start : start + take])
            done, start = done + take, 0
        if tensor.fqn.startswith("optim.exp_avg_sq."):
            value.square_()  # second moments are non-negative
        state[tensor.fqn] = value
    return state
