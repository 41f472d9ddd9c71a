"""``dcp-nvme bench --compress``: the drain's codec on a realistic state, beside plain zstd.

The state comes from a short real training run made here: a small causal transformer trained
on CPU on byte-level text that ships with Python (the standard library's own sources), AdamW;
two checkpoints ``gap`` steps apart. Weights are stored bf16, the AdamW moments fp32. Reported:

- per group (bf16 weights, fp32 exp_avg, fp32 exp_avg_sq) and per zstd level (``levels``, each
  group's levels measured back to back on the same bytes, so a busy machine slows them alike):
  ratio and encode/decode MB/s of the byte-grouped codec (``codec_threads`` threads) beside
  plain zstd at the same level over the same bytes in one stream (what DCP's zstd extension
  does), and zipnn when importable;
- delta: the later checkpoint coded as XOR against the earlier one;
- with ``drain_to``: both checkpoints saved with NVMeWriter; the later one drained with
  ``compress="off"``, ``"bytegroup"`` and ``"auto"`` under a bandwidth cap, and with ``"delta"``
  against the earlier one (drained first, coded full), times compared to ``off``; the
  bytegroup and delta mirrors loaded back and compared bit for bit, each load's decode MB/s
  (CPU time of decoding alone) beside its end-to-end MB/s.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import zstandard

from dcp_nvme.errors import BenchError, InvalidInputError
from dcp_nvme.tiers import codec

GROUPS = ("weights_bf16", "exp_avg_fp32", "exp_avg_sq_fp32")


@dataclass(frozen=True)
class CompressOptions:
    steps: int = 300
    gap: int = 20
    dim: int = 256
    layers: int = 4
    seq: int = 128
    batch: int = 16
    levels: tuple[int, ...] = (codec.DEFAULT_LEVEL,)
    """zstd levels measured per group; the drains use the first."""
    codec_threads: int = 2
    seed: int = 0
    drain_to: str | None = None
    """An fsspec URL or directory, or ``s3-loopback`` (moto from harness/dcp_nvme_harness/s3server.py)."""
    storage_options: dict[str, Any] | None = None
    bandwidth: float | None = 200e6
    directory: str | None = None

    def __post_init__(self) -> None:
        if not self.levels:
            raise InvalidInputError("levels: at least one zstd level")


def stdlib_text(limit: int = 4 << 20) -> bytes:
    """Up to ``limit`` bytes of the standard library's Python sources (real text, always there)."""
    root = sysconfig.get_paths()["stdlib"]
    out, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as handle:
            data = handle.read()
        out.append(data)
        total += len(data)
        if total >= limit:
            break
    return b"".join(out)[:limit]


class TinyLM(torch.nn.Module):
    """A byte-level causal transformer."""

    mask: torch.Tensor  # a registered buffer (Module's __getattr__ is typed Tensor | Module)

    def __init__(self, dim: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True))


def train_snapshots(options: CompressOptions, at_steps: set[int]) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, Any]]:
    """Train ``options.steps`` steps; the groups' state after each step in ``at_steps``, and run facts."""
    torch.manual_seed(options.seed)
    text = torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8).long()
    model = TinyLM(options.dim, options.layers, options.seq)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    started, loss = time.perf_counter(), float("nan")
    for step in range(1, options.steps + 1):
        starts = torch.randint(0, len(text) - options.seq - 1, (options.batch,))
        window = torch.stack([text[s: s + options.seq + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss_t = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        optim.zero_grad()
        loss_t.backward()
        optim.step()
        loss = loss_t.item()
        if step in at_steps:
            snapshots[step] = _groups(model, optim)  # fresh tensors: later steps leave them be
    facts = {"final_loss": round(loss, 4), "params": sum(p.numel() for p in model.parameters()),
             "train_seconds": round(time.perf_counter() - started, 2), "text_bytes": len(text)}
    return snapshots, facts


def train(options: CompressOptions) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Train; return {"early": groups, "late": groups} (``gap`` steps apart) and run facts."""
    early = max(1, options.steps - options.gap)
    snapshots, facts = train_snapshots(options, {early, options.steps})
    return ({"early": snapshots[early], "late": snapshots[options.steps]},
            {"steps": options.steps, "gap": options.steps - early, **facts})


def _groups(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    params = list(model.parameters())
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
    states = [optim.state[p] for p in params]
    return {
        "weights_bf16": flat(params).to(torch.bfloat16),
        "exp_avg_fp32": flat(s["exp_avg"] for s in states).float(),
        "exp_avg_sq_fp32": flat(s["exp_avg_sq"] for s in states).float(),
    }


def group_dtype(group: str) -> str:
    """The codec's dtype name for a group (its byte-plane count follows it)."""
    return "bfloat16" if group.endswith("bf16") else "float32"


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _timed(fn, *args, **kwargs) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, max(time.perf_counter() - started, 1e-9)


def measure_group(data: bytes, dtype: str, level: int, threads: int, base: bytes | None = None) -> dict[str, Any]:
    """Ratios and MB/s of the codec, plain zstd and zipnn (when importable) on the same bytes."""
    regions = [(0, len(data), dtype)]
    coded, enc = _timed(codec.encode, data, regions, level=level, threads=threads, base=base)
    back, dec = _timed(codec.decode, coded, base=base)
    if back != data:
        raise AssertionError(f"{dtype}: the codec's round trip is not bit for bit")
    plain_input = data if base is None else codec._xor(memoryview(data), base)
    plain, zenc = _timed(zstandard.ZstdCompressor(level=level).compress, plain_input)
    mb = len(data) / 1e6
    row: dict[str, Any] = {"bytes": len(data), "bytegroup_ratio": len(data) / len(coded), "bytegroup_encode_MBps": mb / enc,
           "bytegroup_decode_MBps": mb / dec, "zstd_ratio": len(data) / len(plain), "zstd_encode_MBps": mb / zenc}
    row["vs_zstd"] = row["bytegroup_ratio"] / row["zstd_ratio"]
    zipnn = _zipnn(plain_input, dtype)
    if zipnn is not None:
        row.update(zipnn)
    return row


def _zipnn(data: bytes, dtype: str) -> dict[str, float | str] | None:
    try:
        from zipnn import ZipNN
    except Exception:  # noqa: BLE001  optional comparison only
        return None
    try:
        zpn = ZipNN(bytearray_dtype={"bfloat16": "bfloat16", "float32": "float32"}.get(dtype, "float32"))
        out, seconds = _timed(zpn.compress, data)
        return {"zipnn_ratio": len(data) / len(out), "zipnn_encode_MBps": len(data) / 1e6 / seconds}
    except Exception as exc:  # noqa: BLE001
        return {"zipnn_error": f"{type(exc).__name__}: {exc}"}


def run_compress_bench(options: CompressOptions) -> dict[str, Any]:
    snapshots, facts = train(options)
    doc: dict[str, Any] = {"training": facts, "levels": list(options.levels), "level": options.levels[0],
                           "codec_threads": options.codec_threads, "groups": {}, "delta": {}}
    for group in GROUPS:
        dtype = group_dtype(group)
        late, early = _bytes(snapshots["late"][group]), _bytes(snapshots["early"][group])
        full, delta = doc["groups"].setdefault(group, {}), doc["delta"].setdefault(group, {})
        for level in options.levels:  # back to back on the same bytes: the levels compare fairly
            full[str(level)] = measure_group(late, dtype, level, options.codec_threads)
            delta[str(level)] = measure_group(late, dtype, level, options.codec_threads, base=early)
            delta[str(level)]["vs_full"] = delta[str(level)]["bytegroup_ratio"] / full[str(level)]["bytegroup_ratio"]
    if options.drain_to:
        doc["drain"] = drain_rows(snapshots, options)
    return doc


def drain_rows(snapshots: dict[str, dict[str, torch.Tensor]], options: CompressOptions) -> dict[str, Any]:
    """Save both checkpoints; drain the later one plain, byte-grouped, with ``auto`` and as a
    delta against the earlier one under the cap; load the coded mirrors back."""
    import shutil

    from dcp_nvme.tiers import DrainOptions, drain

    root = tempfile.mkdtemp(prefix="dcp-nvme-zbench-", dir=options.directory)
    server = None
    target, storage = options.drain_to, options.storage_options
    if target is None:
        raise BenchError("the compression bench drains only with drain_to (--drain-to)")
    try:
        if target == "s3-loopback":
            server, storage = _loopback_s3()
            target = "s3://zbench"
        first, second = _save_pair(snapshots, os.path.join(root, "run"))
        state = snapshots["late"]
        level = options.levels[0]
        rows: dict[str, Any] = {"bandwidth": options.bandwidth, "target": target, "level": level}

        def drain_one(local: str, mode: str, where: str) -> dict[str, Any]:
            url = target.rstrip("/") + f"/{where}" if "://" in target else os.path.join(target, where)
            drain_options = DrainOptions(compress=mode, bandwidth=options.bandwidth, part_size=8 << 20,
                                         codec_threads=options.codec_threads, level=level, retries=0)
            result, seconds = _timed(drain, local, url, storage_options=storage, options=drain_options)
            return {"url": url, "seconds": seconds, "bytes_sent": result.bytes_sent, **result.compression}

        # the earlier checkpoint first: the delta's base (coded full, the start of a chain)
        rows["delta_base"] = drain_one(first, "delta", "delta_base")
        for mode in ("off", "delta", "bytegroup", "auto"):  # delta beside off: the same checkpoint
            rows[mode] = drain_one(second, mode, mode)
        for mode in ("bytegroup", "delta"):
            rows[mode]["load"] = load_row(rows[mode]["url"], storage, state)
        for mode in ("auto", "bytegroup", "delta"):
            rows[f"speedup_{mode}"] = rows["off"]["seconds"] / rows[mode]["seconds"]
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if server is not None:
            server.stop()


def _save_pair(snapshots: dict[str, dict[str, torch.Tensor]], run_dir: str) -> tuple[str, str]:
    """Save the early and late checkpoints as step_1 and step_2 of one run directory, from the
    same tensors updated in place as training does (benchmarks/delta_gaps.py --drain compares
    that with fresh tensors at every save)."""
    import torch.distributed.checkpoint as dcp

    from dcp_nvme.save.writer import NVMeWriter

    live = {k: v.clone() for k, v in snapshots["early"].items()}
    paths = []
    for step, name in enumerate(("early", "late"), start=1):
        for key, value in snapshots[name].items():
            live[key].copy_(value)
        paths.append(os.path.join(run_dir, f"step_{step}"))
        dcp.save(live, storage_writer=NVMeWriter(paths[-1]), no_dist=True)
    return paths[0], paths[1]


def load_row(where: str, storage: dict[str, Any] | None, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load a mirror into fresh tensors: end-to-end MB/s, the decode's own MB/s (CPU time of
    decoding alone, per core: if it is above the end-to-end rate, the server bounds the load),
    and whether every byte came back."""
    import torch.distributed.checkpoint as dcp

    from dcp_nvme.load.reader import NVMeReader

    out = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = NVMeReader(where, storage_options=storage)
    _, seconds = _timed(dcp.load, out, storage_reader=reader, no_dist=True)
    stats = reader.last_stats or {}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    return {"seconds": seconds, "MBps": nbytes / 1e6 / seconds,
            "decode_MBps_per_core": stats.get("decode_MBps_per_core", 0.0),
            "decode_cpu_seconds": stats.get("decode_cpu_seconds", 0.0), "decoded_bytes": stats.get("decoded_bytes", 0),
            "bitwise_equal": all(torch.equal(out[k].view(torch.uint8), state[k].view(torch.uint8)) for k in state)}


def _loopback_s3():
    """moto's S3 server on a free loopback port (needs ``moto[server]`` and s3fs), bucket ``zbench``."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise BenchError("--drain-to s3-loopback needs moto's server: pip install 'moto[server]' s3fs") from exc
    import fsspec

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    storage = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}",
               "client_kwargs": {"region_name": "us-east-1"}}
    fsspec.filesystem("s3", **storage).mkdir("zbench")
    return server, storage


def format_compress_report(doc: dict[str, Any]) -> str:
    t = doc["training"]
    lines = [f"training: {t['params']} params, {t['steps']} steps (loss {t['final_loss']}), checkpoints "
             f"{t['gap']} steps apart, {t['train_seconds']} s; zstd level(s) "
             f"{', '.join(map(str, doc['levels']))}, {doc['codec_threads']} codec thread(s)", "",
             f"{'group':<18}{'level':>6}{'MB':>8}{'bytegroup':>11}{'zstd':>7}{'vs zstd':>9}{'enc MB/s':>10}"
             f"{'dec MB/s':>10}{'zstd MB/s':>11}{'zipnn':>7}"]
    for title, groups in (("full", doc["groups"]), ("delta", doc["delta"])):
        lines.append(f"-- {title}")
        for name, levels in groups.items():
            for level, r in levels.items():
                zipnn = f"{r['zipnn_ratio']:.2f}x" if "zipnn_ratio" in r else "-"
                lines.append(f"{name:<18}{level:>6}{r['bytes'] / 1e6:>8.1f}{r['bytegroup_ratio']:>10.3f}x"
                             f"{r['zstd_ratio']:>6.3f}x{r['vs_zstd']:>8.3f}x{r['bytegroup_encode_MBps']:>10.0f}"
                             f"{r['bytegroup_decode_MBps']:>10.0f}{r['zstd_encode_MBps']:>11.0f}{zipnn:>7}"
                             + (f"   {r['vs_full']:.2f}x the full ratio" if "vs_full" in r else ""))
    if doc.get("drain"):
        lines += ["", *_drain_lines(doc["drain"])]
    return "\n".join(lines)


def _drain_lines(drain: dict[str, Any]) -> list[str]:
    cap = f"{drain['bandwidth'] / 1e6:.0f} MB/s" if drain["bandwidth"] else "no cap"
    off, auto, forced, delta = drain["off"], drain["auto"], drain["bytegroup"], drain["delta"]
    lines = [f"drain of the later checkpoint to {drain['target']} ({cap}, level {drain['level']}): "
             f"off {off['seconds']:.2f} s",
             f"  auto: {auto['seconds']:.2f} s ({drain['speedup_auto']:.2f}x sooner; "
             f"{auto.get('decision', auto.get('mode'))}; {auto.get('cpu_seconds', 0):.2f} CPU s)",
             f"  bytegroup forced: {forced['seconds']:.2f} s ({drain['speedup_bytegroup']:.2f}x sooner, "
             f"{forced.get('ratio', 1):.3f}x, {forced.get('cpu_seconds', 0):.2f} CPU s)",
             f"  delta against the earlier checkpoint: {delta['seconds']:.2f} s ({drain['speedup_delta']:.2f}x "
             f"sooner, {delta.get('ratio', 1):.3f}x = {delta.get('ratio', 1) / forced.get('ratio', 1):.2f}x the "
             f"full checkpoint's, {delta.get('cpu_seconds', 0):.2f} CPU s{_unless_delta(delta)}); its base "
             f"coded full: {drain['delta_base'].get('ratio', 1):.3f}x in {drain['delta_base']['seconds']:.2f} s"]
    for mode in ("bytegroup", "delta"):
        load = drain[mode]["load"]
        lines.append(f"load from the {mode} mirror: {load['MBps']:.0f} MB/s end to end, decode alone "
                     f"{load['decode_MBps_per_core']:.0f} MB/s per core ({load['decode_cpu_seconds']:.2f} CPU s "
                     f"for {load['decoded_bytes'] / 1e6:.1f} MB), bitwise equal: {load['bitwise_equal']}")
    return lines


def _unless_delta(row: dict[str, Any]) -> str:
    """Why a drain asked for a delta coded full (no base found...), or nothing when it did code one."""
    why = row.get("base", "")
    return "" if why.startswith("delta against") else f"; NOT a delta: {why}"


def dump(doc: dict[str, Any], path: str) -> None:
    with open(path, "w") as handle:
        json.dump(doc, handle, indent=1)
