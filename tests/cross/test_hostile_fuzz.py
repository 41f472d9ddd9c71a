"""Seeded mutation fuzzing of every file kind of a checkpoint.

Each mutant is loaded, verified, inspected and listed (one with something planted under a
drain's own file names is drained instead). Each must end, within a time limit, in
either a dcp_nvme error or the exact original tensors (verify: a report); nothing is read or
written outside the checkpoint directory; the run's peak memory stays bounded. Mutations are
raw byte edits (caught by checksums) and re-sealed structural edits (caught by validation).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.hostile_kit import (
    chunks_of,
    doc_of,
    files_of,
    peak_rss_mib,
    reseal,
    sample_state,
    save,
    within,
    write_blocks,
    write_index,
)
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import NVMeReader
from dcp_nvme.errors import DCPNVMeError
from dcp_nvme.tools import inspect_checkpoint, list_checkpoints, verify_checkpoint

SEED = 1234
MUTANTS_PER_KIND = 40
LIMIT_S = 20


def _flip_bytes(rng: random.Random, path: Path) -> None:
    data = bytearray(path.read_bytes())
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def _truncate_or_extend(rng: random.Random, path: Path) -> None:
    size = path.stat().st_size
    os.truncate(path, rng.choice([rng.randrange(size), size + rng.randrange(1, 1 << 16), 1 << 30]))


EVIL_INTS = [0, -1, 1, 7, 8, 4095, 4096, 1 << 31, 1 << 40, (1 << 63) - 1, -(1 << 63)]
EVIL_NAMES = ["/dev/zero", "../x.safetensors", "/etc/passwd", "", ".", "a/b", "manifest.json"]


def _evil(rng: random.Random, value):
    if isinstance(value, bool) or value is None:
        return rng.choice([None, 1, "true"])
    if isinstance(value, int):
        return rng.choice(EVIL_INTS + [value + rng.choice([-1, 1])])
    if isinstance(value, str):
        return rng.choice(EVIL_NAMES + [value + "x", value.upper()])
    if isinstance(value, tuple):
        if value and rng.random() < 0.6:
            i = rng.randrange(len(value))
            return (*value[:i], _evil(rng, value[i]), *value[i + 1:])
        return rng.choice([(), (1 << 40,), tuple(value) + (1,), (-1,) * 3])
    return value


def _mutate_manifest(rng: random.Random, ckpt: Path) -> None:
    if rng.random() < 0.3:
        _flip_bytes(rng, ckpt / "manifest.json")
        return
    doc = doc_of(ckpt)
    target = rng.choice(["top", "index", "blocks", "files"])
    if target == "top":
        key = rng.choice(["save_key", "world_size", "format_version", "total_bytes", "files", "index"])
        doc[key] = _evil(rng, doc[key]) if not isinstance(doc[key], (list, dict)) else rng.choice([None, 3, {}])
    elif target == "files":
        entry = rng.choice(doc["files"])
        key = rng.choice(["name", "rank", "size"])
        entry[key] = _evil(rng, entry[key])
    else:
        key = rng.choice(["name", "size", "crc32c", "rows"])
        doc[target][key] = _evil(rng, doc[target][key])
    reseal(ckpt, doc)


def _mutate_index(rng: random.Random, ckpt: Path) -> None:
    if rng.random() < 0.25:
        _flip_bytes(rng, ckpt / doc_of(ckpt)["index"]["name"])
        return
    chunks = chunks_of(ckpt)
    i = rng.randrange(len(chunks))
    field = rng.choice(["fqn", "kind", "offsets", "sizes", "global_shape", "dtype", "file", "byte_offset",
                        "length", "key", "dup", "drop"])
    if field == "dup":
        chunks.append(chunks[i])
    elif field == "drop":
        chunks.pop(i)
    elif field == "dtype":
        chunks[i] = replace(chunks[i], dtype=rng.choice(["int32", "float32", "bfloat16", "uint8", "float64",
                                                         "nn", "__class__"]))
    elif field == "kind":
        chunks[i] = replace(chunks[i], kind=rng.choice(["bytes", "tensor", "pickle"]))
    else:
        chunks[i] = replace(chunks[i], **{field: _evil(rng, getattr(chunks[i], field))})
    write_index(ckpt, chunks)


def _mutate_blocks(rng: random.Random, ckpt: Path) -> None:
    if rng.random() < 0.25:
        _flip_bytes(rng, ckpt / doc_of(ckpt)["blocks"]["name"])
        return
    files = files_of(ckpt)
    field = rng.choice(["name", "rank", "size", "data_start", "checksum_block", "header_crc", "crcs"])
    value = getattr(files[0], field)
    if field == "crcs":
        value = rng.choice([(), value[:-1], value + (0,), tuple(c ^ 1 for c in value)])
    elif field == "header_crc":
        value = rng.choice([0, value ^ 1, (1 << 32) - 1])
    else:
        value = _evil(rng, value)
    files[0] = replace(files[0], **{field: value})
    try:
        write_blocks(ckpt, files)
    except (OverflowError, ValueError, TypeError, ImportError) as exc:  # not representable: skip
        if "pyarrow" not in type(exc).__module__ and not isinstance(exc, (OverflowError, TypeError)):
            raise


def _mutate_header(rng: random.Random, ckpt: Path) -> None:
    record = files_of(ckpt)[0]
    path = ckpt / record.name
    data = bytearray(path.read_bytes())
    choice = rng.random()
    if choice < 0.3:  # a new declared header length
        data[:8] = rng.choice([0, 7, 1 << 40, record.data_start, len(data), (1 << 64) - 1]).to_bytes(8, "little")
    else:  # bytes of the JSON header
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(8, record.data_start)] = rng.randrange(256)
    path.write_bytes(bytes(data))


def _mutate_data(rng: random.Random, ckpt: Path) -> None:
    record = files_of(ckpt)[0]
    path = ckpt / record.name
    if rng.random() < 0.3:
        _truncate_or_extend(rng, path)
        return
    data = bytearray(path.read_bytes())
    for _ in range(rng.randint(1, 3)):
        data[rng.randrange(record.data_start, len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def _replace_with_special(rng: random.Random, ckpt: Path) -> None:
    doc = doc_of(ckpt)
    name = rng.choice([doc["index"]["name"], doc["blocks"]["name"], doc["files"][0]["name"], "manifest.json"])
    os.unlink(ckpt / name)
    kind = rng.choice(["fifo", "link_zero", "link_out", "dir"])
    if kind == "fifo":
        os.mkfifo(ckpt / name)
    elif kind == "link_zero":
        os.symlink("/dev/zero", ckpt / name)
    elif kind == "link_out":
        os.symlink(ckpt.parent.parent / "outside" / "bait.bin", ckpt / name)
    else:
        os.mkdir(ckpt / name)


def _plant_in_drain_names(rng: random.Random, ckpt: Path) -> None:
    """A FIFO, directory or link out under a name a (compressed) drain creates: its lock, its
    journal's temp file, its scratch directory or a coded file in it."""
    doc = doc_of(ckpt)
    scratch = f".drain-zip.{doc['save_key']}"
    name = rng.choice([".drain.lock", f"..drain.json.tmp-{os.getpid()}", scratch,
                       f"{scratch}/{doc['files'][0]['name']}.dcz"])
    (ckpt / name).parent.mkdir(exist_ok=True)
    kind = rng.choice(["fifo", "link_out", "dir"])
    outside = ckpt.parent.parent / "outside"
    if kind == "fifo":
        os.mkfifo(ckpt / name)
    elif kind == "link_out":
        os.symlink(outside if name == scratch else outside / "bait.bin", ckpt / name)
    else:
        os.mkdir(ckpt / name)


def _plant_in_save_names(rng: random.Random, ckpt: Path) -> None:
    """A FIFO, directory or link out under a name a save creates beside the checkpoint: the save
    lock, or the pointer for stock DCP users."""
    name = rng.choice([".save.lock", ".metadata.HOW_TO_LOAD.txt"])
    kind = rng.choice(["fifo", "link_out", "dir"])
    (ckpt / name).unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(ckpt / name)
    elif kind == "link_out":
        os.symlink(ckpt.parent.parent / "outside" / "bait.bin", ckpt / name)
    else:
        os.mkdir(ckpt / name)


MUTATORS = {"manifest": _mutate_manifest, "index": _mutate_index, "blocks": _mutate_blocks,
            "header": _mutate_header, "data": _mutate_data, "special": _replace_with_special,
            "drain_names": _plant_in_drain_names, "save_names": _plant_in_save_names}


DCP_CLEAR = ("metadata read failed", "Missing key in checkpoint state_dict")
"""DCP's own clear refusals: a failed read_metadata (quoting our message), and a checkpoint
that lacks a key the destination asks for (a forged, consistent rename)."""


def _is_ours(exc: BaseException) -> bool:
    if isinstance(exc, DCPNVMeError):
        return True
    if isinstance(exc, CheckpointException):
        failures = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        return all(isinstance(f, DCPNVMeError) or any(w in str(f) for w in DCP_CLEAR) for f in failures)
    return False


def _drain(ckpt: Path) -> str:
    """A compressed drain of a checkpoint with something planted under a drain's name: it ends
    drained or with a dcp_nvme error, within the limit, and never writes through what was planted."""
    from dcp_nvme.tiers import DrainOptions, drain

    try:
        within(LIMIT_S, lambda: drain(ckpt, str(ckpt.parent / "mirror"),
                                      options=DrainOptions(retries=0, compress="bytegroup")))
        return "drained"
    except BaseException as exc:  # noqa: BLE001
        assert isinstance(exc, DCPNVMeError), f"drain raised {type(exc).__name__}: {str(exc)[:500]}"
        return "drain refused"


def _save_over(ckpt: Path, state: dict[str, torch.Tensor]) -> str:
    """A save (overwrite) into a checkpoint with something planted under a save's name: it ends
    saved or with a dcp_nvme error, within the limit, and never writes through what was planted."""
    from dcp_nvme import NVMeWriter

    try:
        within(LIMIT_S, lambda: dcp.save(state, storage_writer=NVMeWriter(ckpt, overwrite=True), no_dist=True))
        return "saved"
    except BaseException as exc:  # noqa: BLE001
        assert _is_ours(exc), f"save raised {type(exc).__name__}: {str(exc)[:500]}"
        return "save refused"


def _exercise(ckpt: Path, state: dict[str, torch.Tensor], kind: str = "") -> str:
    if kind == "drain_names":
        return _drain(ckpt)
    if kind == "save_names":
        return _save_over(ckpt, state)
    dest = {k: torch.full_like(v, 7) for k, v in state.items()}
    try:
        within(LIMIT_S, lambda: dcp.load(dest, storage_reader=NVMeReader(ckpt), no_dist=True))
        outcome = "loaded"
        for k, v in state.items():
            assert torch.equal(dest[k], v), f"{k} loaded silently wrong"
    except AssertionError:
        raise
    except BaseException as exc:  # noqa: BLE001
        assert _is_ours(exc), f"load raised {type(exc).__name__}: {str(exc)[:500]}"
        outcome = "refused" if not any(w in str(exc) for w in DCP_CLEAR[1:]) else "renamed"
    report = within(LIMIT_S, lambda: verify_checkpoint(ckpt))
    if outcome == "refused":  # a renamed key is a consistent checkpoint, not a damaged one
        assert not report.ok, "load refused a checkpoint that verify calls intact"
    for tool in (lambda: inspect_checkpoint(ckpt), lambda: list_checkpoints(ckpt.parent)):
        try:
            within(LIMIT_S, tool)
        except DCPNVMeError:
            pass
    return outcome


def fuzz(work: Path, seed: int = SEED, per_kind: int = MUTANTS_PER_KIND) -> dict[str, int]:
    """Run the loop; returns outcome counts. Asserts on any failure of the properties."""
    rng = random.Random(seed)
    state = sample_state()
    state["obj"] = torch.tensor(3)
    pristine = save(work / "pristine", state)
    outside = work / "outside"
    outside.mkdir()
    bait = os.urandom(1 << 16)
    (outside / "bait.bin").write_bytes(bait)
    before = sorted(p.name for p in work.iterdir())
    counts: dict[str, int] = {}
    for kind, mutate in MUTATORS.items():
        for n in range(per_kind):
            run = work / "runs" / f"{kind}_{n}"
            shutil.rmtree(work / "runs", ignore_errors=True)
            shutil.copytree(pristine, run)
            mutate(rng, run)
            outcome = _exercise(run, state, kind)
            counts[f"{kind}:{outcome}"] = counts.get(f"{kind}:{outcome}", 0) + 1
    shutil.rmtree(work / "runs", ignore_errors=True)
    assert sorted(p.name for p in work.iterdir()) == before, "a file appeared outside the checkpoint"
    assert sorted(p.name for p in outside.iterdir()) == ["bait.bin"]
    assert (outside / "bait.bin").read_bytes() == bait, "a file outside the checkpoint was written"
    return counts


@pytest.mark.slow  # other processes
def test_mutation_fuzz(tmp_path: Path):
    code = ("import json, logging, importlib.util; logging.disable(logging.CRITICAL)\n"
            f"spec = importlib.util.spec_from_file_location('fuzz_module', {__file__!r})\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); fuzz = module.fuzz\n"
            f"print('COUNTS', json.dumps(fuzz(__import__('pathlib').Path({str(tmp_path)!r}))))")
    peak, out = peak_rss_mib(code, timeout=600)
    counts = json.loads(next(line for line in out.splitlines() if line.startswith("COUNTS"))[7:])
    print(counts, f"peak {peak:.0f} MiB")
    assert sum(counts.values()) == len(MUTATORS) * MUTANTS_PER_KIND
    assert sum(v for k, v in counts.items() if not k.endswith("loaded")) >= len(MUTATORS) * MUTANTS_PER_KIND // 2
    assert peak < 1024, f"peak memory {peak:.0f} MiB"


if __name__ == "__main__":
    print(fuzz(Path(sys.argv[1])))
