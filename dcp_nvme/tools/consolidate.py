"""Pure planning for export: which tensors, under which names and dtypes, in which shard, and
which byte ranges of which container fill which bytes of each full tensor. No I/O here."""

from __future__ import annotations

import fnmatch
import glob
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dcp_nvme.errors import InvalidInputError
from dcp_nvme.format.container import ST_DTYPES, parse_dtype
from dcp_nvme.format.tables import ChunkRecord
from dcp_nvme.load.planning import Need, count_runs, slice_runs

MAX_RUNS_PER_READ = 16384
"""Runs planned at once for one chunk; bounds the planner's lists for finely split chunks."""

DTYPE_ALIASES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "f16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "f32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "f64": torch.float64, "float64": torch.float64,
    "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


def parse_out_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPE_ALIASES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise InvalidInputError(f"unknown --dtype {name!r}; use one of {sorted(DTYPE_ALIASES)}") from None


MODEL_KEYS = ("model", "module", "state_dict", "model_state_dict", "model_state")
"""Top-level keys that hold a model's weights in the usual training state dicts (DCP's own
examples and Hugging Face's FSDP: ``model``; Lightning: ``state_dict``; DeepSpeed: ``module``)."""
TRAINING_KEYS = ("optimizer", "optimizers", "optim", "opt", "optimizer_states", "optimizer_state_dict",
                 "lr_scheduler", "lr_schedulers", "scheduler", "dataloader", "train_state", "rng", "rng_state")
"""Top-level keys of training state that a model export leaves out (torchtitan keeps the model's
weights at the top level and its optimizer under ``optimizer``)."""


@dataclass(frozen=True)
class Selection:
    """What a model export takes by default: globs, the prefix removed, what it leaves out."""

    keys: list[str] | None
    strip_prefix: str | None
    left_out: dict[str, int]
    """Top-level key -> tensors under it that are not exported."""


def model_selection(fqns: Sequence[str]) -> Selection:
    """The model's weights under the names Hugging Face expects: the tensors under the first
    of ``MODEL_KEYS`` with that key removed (``model.lm_head.weight`` -> ``lm_head.weight``), else
    every tensor outside ``TRAINING_KEYS``, named as stored."""
    tops: dict[str, int] = {}
    for fqn in fqns:
        top = fqn.split(".", 1)[0]
        tops[top] = tops.get(top, 0) + 1
    model = next((k for k in MODEL_KEYS if k in tops and any(f.startswith(k + ".") for f in fqns)), None)
    if model is not None:
        return Selection([glob.escape(model) + ".*"], f"{model}.", {k: n for k, n in tops.items() if k != model})
    left = {k: n for k, n in tops.items() if k in TRAINING_KEYS}
    if not left:
        return Selection(None, None, {})
    kept = sorted(k for k in tops if k not in left)
    if not kept:
        raise InvalidInputError(f"found no model weights, only training state ({', '.join(sorted(left))}); "
                                "pass --include-optimizer to export it, or --keys to choose")
    names = set(fqns)
    globs = [pattern for k in kept for pattern, present in (
        (glob.escape(k), k in names), (glob.escape(k) + ".*", tops[k] > (k in names))) if present]
    return Selection(globs, None, left)


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its stored chunks and how it is written."""

    name: str
    fqn: str
    stored: torch.dtype
    out: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stored_nbytes(self) -> int:
        return self.numel * self.stored.itemsize

    @property
    def entry(self) -> tuple[str, str, tuple[int, ...], int]:
        """``(key, st_dtype, shape, nbytes)`` as ``format.container.build_header`` takes it."""
        return self.name, ST_DTYPES[self.out], self.shape, self.nbytes

    @property
    def nbytes(self) -> int:
        return self.numel * self.out.itemsize


def select_tensors(
    chunks: Sequence[ChunkRecord],
    *,
    keys: Sequence[str] | None = None,
    strip_prefix: str | None = None,
    dtype: torch.dtype | None = None,
    location: str = "the checkpoint",
) -> list[TensorPlan]:
    """The tensors to export, in index order; every way it cannot work is a ValueError."""
    by_fqn: dict[str, list[ChunkRecord]] = {}
    for chunk in chunks:
        if chunk.kind == "tensor":
            by_fqn.setdefault(chunk.fqn, []).append(chunk)
    if keys:
        unmatched = [k for k in keys if not any(fnmatch.fnmatchcase(f, k) for f in by_fqn)]
        if unmatched:
            raise InvalidInputError(f"--keys {', '.join(map(repr, unmatched))} matches no tensor of {location} "
                             "(see `dcp-nvme inspect` for the names)")
        by_fqn = {f: c for f, c in by_fqn.items() if any(fnmatch.fnmatchcase(f, k) for k in keys)}
    if not by_fqn:
        raise InvalidInputError(f"{location} holds no tensors to export")
    plans, unstorable = [], []
    names: dict[str, str] = {}  # safetensors name -> the fqn it came from
    for fqn, parts in by_fqn.items():
        stored = parse_dtype(parts[0].dtype)
        out = dtype if dtype is not None and stored.is_floating_point else stored
        if out not in ST_DTYPES:
            unstorable.append(f"{fqn} ({stored})")
            continue
        name = fqn[len(strip_prefix):] if strip_prefix and fqn.startswith(strip_prefix) else fqn
        if not name:
            raise InvalidInputError(f"--strip-prefix {strip_prefix!r} leaves tensor {fqn!r} without a name")
        if name in names:
            raise InvalidInputError(f"tensors {names[name]!r} and {fqn!r} both become {name!r}")
        names[name] = fqn
        shape = tuple(parts[0].global_shape)
        _check_cover(fqn, shape, stored, parts)
        plans.append(TensorPlan(name, fqn, stored, out, shape, tuple(parts)))
    if unstorable:
        hint = "pass --dtype (e.g. bf16) to cast floating tensors" if dtype is None else \
            "these are not floating point, so --dtype does not apply; leave them out with --keys"
        raise InvalidInputError(f"safetensors cannot store the dtype of {len(unstorable)} tensor(s): "
                         f"{', '.join(unstorable[:5])}; {hint}")
    return plans


def _check_cover(fqn: str, shape: tuple[int, ...], dtype: torch.dtype, parts: Sequence[ChunkRecord]) -> None:
    """The chunks must tile the tensor: their elements add up and none leaves the shape."""
    total = 0
    for part in parts:
        if tuple(part.global_shape) != shape or part.dtype != parts[0].dtype:
            raise InvalidInputError(f"{fqn}: chunks disagree on shape or dtype; the index is inconsistent")
        if any(o + s > g for o, s, g in zip(part.offsets, part.sizes, shape)):
            raise InvalidInputError(f"{fqn}: chunk at {part.offsets} of size {part.sizes} lies outside {shape}")
        total += math.prod(part.sizes)
    if total != math.prod(shape):
        raise InvalidInputError(f"{fqn}: the stored chunks hold {total} of {math.prod(shape)} elements; "
                         "the checkpoint does not hold the whole tensor")


def plan_shards(tensors: Sequence[TensorPlan], max_shard_size: int) -> list[list[TensorPlan]]:
    """Tensors in order, a new shard whenever the next would pass ``max_shard_size`` (as
    transformers does); a tensor larger than the limit gets a shard of its own."""
    if max_shard_size <= 0:
        raise InvalidInputError(f"--max-shard-size must be positive, got {max_shard_size}")
    shards: list[list[TensorPlan]] = []
    size = 0
    for tensor in tensors:
        if not shards or (size + tensor.nbytes > max_shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def chunk_needs(chunk: ChunkRecord, itemsize: int, dest: int,
                max_runs: int = MAX_RUNS_PER_READ) -> Iterator[list[Need]]:
    """Groups of reads that put the chunk's bytes where they belong in the full tensor.

    Each run of the chunk (contiguous in the file and in the full tensor) is one Need from the
    container straight into the full tensor's bytes ``dest``. Chunks with many runs are planned
    a group of dim-0 rows at a time.
    """
    shape, offsets, sizes = tuple(chunk.global_shape), tuple(chunk.offsets), tuple(chunk.sizes)
    if count_runs(shape, offsets, sizes) == 0:
        return
    if not shape:
        yield [Need(chunk.byte_offset, itemsize, dest, 0)]
        return
    rows = sizes[0]
    per_row = count_runs(shape, (offsets[0], *offsets[1:]), (1, *sizes[1:]))
    total = count_runs(shape, offsets, sizes)
    step = rows if total <= max_runs else max(1, max_runs // per_row)
    row_bytes = math.prod(sizes[1:]) * itemsize
    for row in range(0, rows, step):
        take = min(step, rows - row)
        base = chunk.byte_offset + row * row_bytes
        runs = slice_runs(shape, (offsets[0] + row, *offsets[1:]), (take, *sizes[1:]), itemsize)
        yield [Need(base + packed, nbytes, dest, src) for src, nbytes, packed in runs]
