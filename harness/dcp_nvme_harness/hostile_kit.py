"""Tools to forge checkpoints the way a hostile author would: rewrite a table or the manifest
and re-seal every checksum that protects it, so only our validation stands in the way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeWriter
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.format.manifest import fqn_keys, read_files, read_manifest, seal, table_entry
from dcp_nvme.format.tables import ChunkRecord, FileRecord, chunks_table, files_table
from dcp_nvme.storage.local_dir import LocalStore

ROOT = Path(__file__).resolve().parents[2]  # the checkout (the harness is installed editable)


def save(path: Path, state: dict) -> Path:
    dcp.save(state, storage_writer=NVMeWriter(path), no_dist=True)
    return path


def doc_of(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def chunks_of(path: Path) -> list[ChunkRecord]:
    return read_manifest(LocalStore(path), str(path)).chunks


def files_of(path: Path) -> list[FileRecord]:
    store = LocalStore(path)
    return list(read_files(store, read_manifest(store, str(path)), str(path)).values())


def reseal(path: Path, doc: dict[str, Any]) -> None:
    doc = {k: v for k, v in doc.items() if k != "manifest_crc32c"}
    (path / MANIFEST).write_bytes(seal(doc))


def write_index(path: Path, chunks: list[ChunkRecord], doc: dict[str, Any] | None = None) -> None:
    """Replace the index with ``chunks`` and re-seal the manifest around it."""
    doc = doc or doc_of(path)
    data = chunks_table(chunks, fqn_keys(doc))  # null keys mean what the checkpoint's version says
    (path / doc["index"]["name"]).write_bytes(data)
    doc["index"] = table_entry(doc["index"]["name"], data)
    reseal(path, doc)


def write_blocks(path: Path, files: list[FileRecord], doc: dict[str, Any] | None = None) -> None:
    doc = doc or doc_of(path)
    data = files_table(files)
    (path / doc["blocks"]["name"]).write_bytes(data)
    doc["blocks"] = table_entry(doc["blocks"]["name"], data)
    reseal(path, doc)


def rewrite_header(path: Path, name: str, edit: Callable[[dict], None]) -> None:
    """Edit a container's JSON header in place (same length, space padded) and re-seal its crc."""
    data = bytearray((path / name).read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    data[8 : 8 + length] = text + b" " * (length - len(text))
    (path / name).write_bytes(bytes(data))
    files = files_of(path)
    files = [replace(f, header_crc=crc32c.crc32c(bytes(data[: f.data_start]))) if f.name == name else f
             for f in files]
    write_blocks(path, files)


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, failing the test (not hanging it) when it has not returned in time."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001  (handed to the caller)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: it hangs"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def peak_rss_mib(code: str, timeout: float = 240) -> tuple[float, str]:
    """Run ``code`` in a fresh interpreter; its peak resident memory (VmHWM) in MiB, and its stdout."""
    script = code + "\nprint('VMHWM', [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\n"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("VMHWM"))
    return int(line.split()[1]) / 1024, proc.stdout


def sample_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a": torch.randn(64, 32),
        "b": torch.randn(64, 32),  # the same size as "a": a swap of offsets keeps every length
        "i": torch.arange(2048, dtype=torch.int32),  # the same byte size as "a" in float32
        "h": torch.randn(100).to(torch.bfloat16),
    }
