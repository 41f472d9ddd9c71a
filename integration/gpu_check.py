#!/usr/bin/env python
"""GPU check for the kvikio (cuFile) engine: one script, well under 5 minutes on one GPU.

    python -m integration.gpu_check [--size-mb 512] [--tensors 300] [--dir PATH] [--require-cuda]

Checks, one line each, then ``N passed, N failed, N skipped``; measurements go to
``$OUT/gpu_check.json`` when ``$OUT`` is set. Without CUDA it says so and exits 0 (1 with
``--require-cuda``). See docs/gpu.md for the device run procedure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # run from it (`python -m`): this checkout's dcp_nvme


class Report:
    def __init__(self) -> None:
        self.results: list[dict] = []
        self.figures: dict[str, object] = {}

    def run(self, name: str, fn) -> None:
        started = time.perf_counter()
        try:
            outcome = fn()
            status, detail = ("pass", outcome) if not isinstance(outcome, tuple) else outcome
        except Exception as exc:  # noqa: BLE001 - a failed check is reported, the next one runs
            status, detail = "fail", f"{type(exc).__name__}: {exc}"
            traceback.print_exc(limit=4)
        seconds = time.perf_counter() - started
        self.results.append({"check": name, "status": status, "detail": detail, "seconds": round(seconds, 3)})
        print(f"{status.upper():4} {name} ({seconds:.1f} s): {detail}", flush=True)

    def count(self, status: str) -> int:
        return sum(r["status"] == status for r in self.results)

    def finish(self, extra: dict) -> None:
        summary = f"{self.count('pass')} passed, {self.count('fail')} failed, {self.count('skip')} skipped"
        print(summary, flush=True)
        out = os.environ.get("OUT")
        if out:
            doc = {**extra, "passed": self.count("pass"), "failed": self.count("fail"),
                   "skipped": self.count("skip"), "checks": self.results, "figures": self.figures}
            Path(out, "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))


def fs_type(path: Path) -> str:
    best, kind = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype, *_ = line.split()
            if str(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    except OSError:
        pass
    return kind


def drop_cache(directory: Path) -> None:
    """Evict a checkpoint's pages so a load reads the disk (clean pages after fsync)."""
    from dcp_nvme.observe.machine import evict_from_page_cache

    evict_from_page_cache([str(f) for f in directory.rglob("*") if f.is_file()])


def make_state(total_mb: int, count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` device tensors, bf16 and fp32 alternating, ~``total_mb`` MiB, uneven sizes."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weights = torch.rand(count, generator=torch.Generator().manual_seed(seed)) + 0.05
    budget = (weights / weights.sum() * total_mb * (1 << 20)).long().tolist()
    state = {}
    for i, nbytes in enumerate(budget):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        cols = 1024 + 7 * (i % 5)
        rows = max(1, nbytes // (cols * torch.tensor([], dtype=dtype).element_size()))
        state[f"layer{i:04d}.{'w' if i % 2 == 0 else 'b'}"] = torch.randn(
            rows, cols, device="cuda", generator=gen, dtype=torch.float32).to(dtype)
    return state


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--dir", default=os.environ.get("GPU_CHECK_DIR", str(ROOT / ".gpu_check_work")))
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--require-cuda", action="store_true")
    args = parser.parse_args()
    report = Report()
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available()}
    if not info["cuda"]:
        print("gpu_check: no CUDA (torch.cuda.is_available() is False): nothing to check here; "
              "run it on the GPU machine (docs/gpu.md)")
        report.finish(info)
        return 1 if args.require_cuda else 0

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from dcp_nvme import NVMeReader, NVMeWriter
    from dcp_nvme.config import IOConfig
    from dcp_nvme.engines import kvikio_unavailable_reason, shared_engine
    from dcp_nvme.engines.kvikio import KvikioEngine
    from dcp_nvme.engines.posix import PosixEngine
    from dcp_nvme.format.container import ItemSpec, plan_container
    from dcp_nvme.format.device_checksums import device_crc32c
    from dcp_nvme.load.planning import FileBlocks, Need, plan_reads

    work = Path(args.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    info.update(device=torch.cuda.get_device_name(0), work_dir=str(work), filesystem=fs_type(work),
                size_mb=args.size_mb, tensors=args.tensors, queue_depth=args.queue_depth)
    try:
        import kvikio

        info.update(kvikio=kvikio.__version__, compat_preferred=kvikio.defaults.is_compat_mode_preferred(),
                    kvikio_compat_mode=str(kvikio.defaults.get("compat_mode")))
    except Exception as exc:  # noqa: BLE001
        info["kvikio"] = f"unavailable: {exc}"
    print("gpu_check:", json.dumps(info), flush=True)
    figures = report.figures
    qd = args.queue_depth
    options = dict(queue_depth=qd, block_size="8MiB")
    state = make_state(args.size_mb, args.tensors)
    total = nbytes(state)
    figures["state_bytes"] = total
    torch.cuda.synchronize()

    def available():
        reason = kvikio_unavailable_reason(str(work))
        if reason:
            raise RuntimeError(reason)
        return "probe write/read through kvikio succeeded"

    report.run("kvikio available (CUDA, import, probe I/O)", available)

    def device_crc():
        data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
        import crc32c

        torch.cuda.synchronize()
        started = time.perf_counter()
        got = device_crc32c(data, 1 << 20)
        seconds = time.perf_counter() - started
        raw = data.cpu().numpy().tobytes()
        expected = [crc32c.crc32c(raw[i : i + (1 << 20)]) for i in range(0, len(raw), 1 << 20)]
        assert got == expected, "device crc32c differs from the crc32c library"
        figures["device_crc32c_gbps"] = round(len(raw) / seconds / 1e9, 2)
        return f"64 MiB, equal to the crc32c library, {figures['device_crc32c_gbps']} GB/s (one stream)"

    report.run("device crc32c == host crc32c", device_crc)

    def engine_round_trip():
        config = IOConfig(queue_depth=qd, block_size=8 << 20, direct_io=True)
        sources = [t.reshape(-1).view(torch.uint8) for t in state.values()]
        items = [ItemSpec(f"t{i}", s.numel(), "U8", (s.numel(),)) for i, s in enumerate(sources)]
        layout = plan_container(items, {"format": "gpu_check"})
        engine = KvikioEngine(config)
        path_k, path_p = str(work / "engine_kvikio.bin"), str(work / "engine_posix.bin")
        written = engine.write_file(path_k, layout.header, sources, config.checksum_block)
        reference = PosixEngine(config).write_file(path_p, layout.header, sources, config.checksum_block)
        assert written.crcs == reference.crcs, "crc32c of the kvikio write differs from POSIX's"
        assert Path(path_k).read_bytes() == Path(path_p).read_bytes(), "files differ"
        assert engine.device_bytes["write"] == layout.data_size, "some device bytes bypassed cuFile"
        assert written.stats.max_inflight <= qd
        dests = [torch.zeros_like(s) for s in sources]
        needs = [Need(layout.data_start + off, s.numel(), i, 0)
                 for i, (off, s) in enumerate(zip(layout.offsets, sources))]
        blocks = FileBlocks(written.data_start, layout.data_size, written.checksum_block, written.crcs)
        drop_cache(work)
        read = engine.read(plan_reads(path_k, needs, max_request=config.block_size, blocks=blocks), dests)
        assert all(torch.equal(d, s) for d, s in zip(dests, sources)), "read back differs"
        assert read.max_inflight <= qd
        figures["engine_write"] = written.stats.to_dict()
        figures["engine_read"] = read.to_dict()
        return (f"{layout.data_size / 1e9:.2f} GB: write {written.stats.gbps:.2f} GB/s, read {read.gbps:.2f}"
                f" GB/s, depth {written.stats.max_inflight}/{read.max_inflight} <= {qd}, file == POSIX's")

    report.run("engine round trip kvikio, byte-identical to POSIX", engine_round_trip)

    def dcp_pair(write_engine: str, read_engine: str):
        target = work / f"dcp_{write_engine}_{read_engine}"
        writer = NVMeWriter(target, engine=write_engine, **options)
        dcp.save(state, storage_writer=writer, no_dist=True)
        back = blank(state)
        reader_engine, _ = shared_engine(NVMeReader(target, engine=read_engine, **options).config, True)
        before = getattr(reader_engine, "device_bytes", {}).get("read", 0)
        dcp.load(back, storage_reader=NVMeReader(target, engine=read_engine, **options), no_dist=True)
        assert same(state, back), "loaded tensors differ"
        io = writer.last_stats["io"]
        assert io["max_inflight"] <= qd, f"queue depth {io['max_inflight']} > {qd}"
        via = getattr(reader_engine, "device_bytes", {}).get("read", 0) - before
        return (f"saved by {writer.last_stats['engine']} ({writer.last_stats['engine_reason']}), "
                f"depth {io['max_inflight']}, loaded by {read_engine} ({via / 1e9:.2f} GB via cuFile)")

    for pair in (("kvikio", "kvikio"), ("kvikio", "posix"), ("posix", "kvikio")):
        report.run(f"dcp save {pair[0]} -> load {pair[1]}, byte-identical", lambda p=pair: dcp_pair(*p))

    def load_straight_to_device():
        target = work / "dcp_kvikio_kvikio"
        engine, _ = shared_engine(NVMeReader(target, engine="kvikio", **options).config, True)
        before = engine.device_bytes["read"]
        dcp.load(blank(state), storage_reader=NVMeReader(target, engine="kvikio", **options), no_dist=True)
        moved = engine.device_bytes["read"] - before
        if moved < total:
            raise AssertionError(f"only {moved} of {total} bytes were read by cuFile into device "
                                 "memory: NVMeReader staged device targets through host temporaries")
        return f"{moved / 1e9:.2f} GB read by cuFile straight into device tensors"

    report.run("dcp load reads device tensors through cuFile", load_straight_to_device)

    def timing():
        rows = {}
        for name, make_writer, make_reader in (
            ("nvme_auto", lambda d: NVMeWriter(d, **options), lambda d: NVMeReader(d, **options)),
            ("nvme_posix", lambda d: NVMeWriter(d, engine="posix", **options),
             lambda d: NVMeReader(d, engine="posix", **options)),
            ("filesystem", lambda d: FileSystemWriter(str(d)), lambda d: FileSystemReader(str(d))),
        ):
            target = work / f"time_{name}"
            torch.cuda.synchronize()
            started = time.perf_counter()
            dcp.save(state, storage_writer=make_writer(target), no_dist=True)
            save_s = time.perf_counter() - started
            drop_cache(target)
            back = blank(state)
            torch.cuda.synchronize()
            started = time.perf_counter()
            dcp.load(back, storage_reader=make_reader(target), no_dist=True)
            torch.cuda.synchronize()
            load_s = time.perf_counter() - started
            assert same(state, back), f"{name}: loaded tensors differ"
            rows[name] = {"save_s": round(save_s, 3), "load_s": round(load_s, 3),
                          "save_gbps": round(total / save_s / 1e9, 2), "load_gbps": round(total / load_s / 1e9, 2)}
            shutil.rmtree(target)
        figures["dcp_timing"] = rows
        return ", ".join(f"{k} save {v['save_gbps']} / load {v['load_gbps']} GB/s" for k, v in rows.items())

    report.run("save/load GB/s beside FileSystemWriter (same device tensors)", timing)

    def async_save():
        try:
            from dcp_nvme.save.stager import NVMeStager
        except ImportError as exc:
            return "skip", f"dcp_nvme.save.stager not available ({exc})"
        torch.cuda.synchronize()
        started = time.perf_counter()
        plain = {k: v.to("cpu") for k, v in state.items()}
        torch.cuda.synchronize()
        d2h_s = time.perf_counter() - started
        del plain
        stager = NVMeStager()
        target = work / "async"
        for _attempt in range(2):  # the first save allocates the arena; the second reuses it
            torch.cuda.synchronize()
            started = time.perf_counter()
            response = dcp.async_save(state, storage_writer=NVMeWriter(target, overwrite=True, **options),
                                      async_stager=stager, no_dist=True)
            blocking_s = time.perf_counter() - started
            getattr(response, "upload_completion", response).result()
        back = blank(state)
        dcp.load(back, storage_reader=NVMeReader(target, **options), no_dist=True)
        assert same(state, back), "async save: loaded tensors differ"
        figures["async"] = {"blocking_s": round(blocking_s, 3), "plain_d2h_s": round(d2h_s, 3)}
        return f"blocking {blocking_s:.3f} s (second save) vs plain .to('cpu') {d2h_s:.3f} s"

    report.run("async_save with NVMeStager from device tensors", async_save)

    def dtensor():
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cuda", (1,))
            names = list(state)[:50]
            sd = {k: distribute_tensor(state[k], mesh, [Shard(0)]) for k in names}
            target = work / "dtensor"
            dcp.save(sd, storage_writer=NVMeWriter(target, engine="kvikio", **options))
            back = {k: distribute_tensor(torch.zeros_like(state[k]), mesh, [Shard(0)]) for k in names}
            dcp.load(back, storage_reader=NVMeReader(target, engine="kvikio", **options))
            assert all(torch.equal(back[k].full_tensor().view(torch.uint8), state[k].view(torch.uint8))
                       for k in names), "DTensor round trip differs"
            return f"{len(names)} DTensors (Shard(0), 1-GPU mesh) saved and loaded through kvikio"
        finally:
            dist.destroy_process_group()

    report.run("DTensor on a 1-GPU mesh through kvikio", dtensor)

    shutil.rmtree(work, ignore_errors=True)
    report.finish(info)
    return 1 if report.count("fail") else 0


if __name__ == "__main__":
    sys.exit(main())
