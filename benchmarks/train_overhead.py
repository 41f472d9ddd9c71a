"""What does a checkpoint cost training? A real training loop, a checkpoint every k steps.

The model is the small byte-level causal transformer the compression bench trains on CPU
(``dcp_nvme.bench.compression.TinyLM``, AdamW, the standard library's sources as text). One run,
interleaved: each round runs one segment of ``k`` steps per method, in a rotating order:

- none: no checkpoint (the baseline);
- nvme: ``dcp.async_save`` with NVMeWriter and one persistent NVMeStager;
- nvme_saver: ``NVMeAsyncSaver`` (one persistent save thread, its own NVMeStager; the
  NVMeWriter is made on the save thread);
- dcp: ``dcp.async_save`` with FileSystemWriter and one persistent DefaultStager with async
  staging (pinned memory and non-blocking copies where CUDA is present: DCP's best set-up);
- torch_checkpointing: its async saver (staging thread, writer subprocess), when installed.

In a segment the save is started after the first step's optimizer step; the next optimizer step
first waits for ``staging_completion`` (the loop a trainer runs: torchtitan's
``maybe_wait_for_staging``); at the end of the segment the upload is awaited, so no save leaks
into the next segment. Reported per method: steps/s, overhead in % of the baseline's training
time (median over rounds of each round's paired ratio), and per save: seconds async_save held
the caller (blocking), seconds until staged, seconds the optimizer step waited for staging,
seconds until durable, seconds the segment's end still waited for the upload. A last, untimed
segment per NVMe method checks that its checkpoint holds the values of the step it was taken at.
Ratios to each peer (blocking, durable) are reported for ours; targets live in docs/benchmarks.md.

    python benchmarks/train_overhead.py --every 20 --rounds 12 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager

from dcp_nvme import NVMeAsyncSaver, NVMeReader, NVMeStager, NVMeWriter
from dcp_nvme.bench.compression import TinyLM, stdlib_text


def _sibling(name: str):
    """A module of this directory, by its file: this file is also loaded by path (by a test)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dcp_best_options = _sibling("async_save").dcp_best_options  # the async bench's set-up of DCP's stager

OURS = ("nvme", "nvme_saver")
PEERS = ("dcp", "torch_checkpointing")


class Trainer:
    """The training loop: one step = batch, forward, backward, [wait for staging], optimizer step."""

    def __init__(self, dim: int, layers: int, seq: int, batch: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.text = torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8).long()
        self.model = TinyLM(dim, layers, seq)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1)
        self.seq, self.batch = seq, batch

    def step(self, before_update: Callable[[], None] | None = None) -> None:
        starts = torch.randint(0, len(self.text) - self.seq - 1, (self.batch,))
        window = torch.stack([self.text[s: s + self.seq + 1] for s in starts.tolist()])
        logits = self.model(window[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        self.optim.zero_grad(set_to_none=False)
        loss.backward()
        if before_update is not None:
            before_update()  # the tensors are written next: staging must be done
        self.optim.step()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}


class Save:
    """One save in flight: when it returned, was staged and was durable (perf_counter stamps)."""

    def __init__(self, started: float, returned: float, staging, upload) -> None:
        self.started, self.returned = started, returned
        self.staging, self.upload = staging, upload
        self.staged_at = self.durable_at = None
        staging.add_done_callback(lambda _f: setattr(self, "staged_at", time.perf_counter()))
        upload.add_done_callback(lambda _f: setattr(self, "durable_at", time.perf_counter()))


class Method:
    name = ""

    def save(self, state: dict, path: str) -> tuple[Any, Any]:
        """Start a save; returns (staging future, upload future)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class NVMe(Method):
    name = "nvme"

    def __init__(self) -> None:
        self.stager = NVMeStager()

    def save(self, state, path):
        resp = dcp.async_save(state, storage_writer=NVMeWriter(path), async_stager=self.stager, no_dist=True)
        return resp.staging_completion, resp.upload_completion

    def close(self) -> None:
        self.stager.close()


class NVMeSaver(Method):
    name = "nvme_saver"

    def __init__(self) -> None:
        self.saver = NVMeAsyncSaver()

    def save(self, state, path):
        # checkpoint_id: the saver builds the NVMeWriter on its thread, not the training loop's
        resp = self.saver.save(state, checkpoint_id=path, no_dist=True)
        return resp.staging_completion, resp.upload_completion

    def close(self) -> None:
        self.saver.close()


class DCPBest(Method):
    name = "dcp"

    def __init__(self) -> None:
        self.stager = DefaultStager(dcp_best_options())

    def save(self, state, path):
        resp = dcp.async_save(state, storage_writer=FileSystemWriter(path), async_stager=self.stager, no_dist=True)
        return resp.staging_completion, resp.upload_completion

    def close(self) -> None:
        self.stager.close()


class TorchCheckpointing(Method):
    """torch_checkpointing's async saver with its defaults but buffered writes (its O_DIRECT
    writer fails with EINVAL on filesystems that refuse unaligned direct writes) and a longer
    wait for its writer process to start."""

    name = "torch_checkpointing"

    def __init__(self) -> None:
        from torch_checkpointing import (
            AsyncCheckpointSaverConfig,
            CheckpointBase,
            CheckpointItem,
            make_async_checkpoint_saver,
        )
        from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        class Checkpoint(CheckpointBase):
            def __init__(self, state: dict) -> None:
                self.state = state

            def get_items(self) -> dict:
                return {key: CheckpointItem(value=value) for key, value in self.state.items()}

            def load_state_dict(self, state_dict: dict) -> None:
                self.state = state_dict

        self.checkpoint = Checkpoint
        self.saver = make_async_checkpoint_saver(
            # its writer process may take longer than the default 30 s to start on a loaded machine
            AsyncCheckpointSaverConfig(process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=600)),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False))

    def save(self, state, path):
        return self.saver.save(path, self.checkpoint(state))

    def close(self) -> None:
        self.saver.close()


def segment(trainer: Trainer, every: int, method: Method | None, path: str) -> dict[str, float]:
    """``every`` training steps; with a method, a save after the first step's update."""
    pending: list[Save] = []
    waited = [0.0]

    def wait_for_staging() -> None:
        if pending and not pending[-1].staging.done():
            started = time.perf_counter()
            pending[-1].staging.result()
            waited[0] += time.perf_counter() - started

    started = time.perf_counter()
    for i in range(every):
        trainer.step(wait_for_staging)
        if i == 0 and method is not None:
            state = trainer.state()
            called = time.perf_counter()
            staging, upload = method.save(state, path)
            pending.append(Save(called, time.perf_counter(), staging, upload))
            del state
    residual = 0.0
    if pending:
        before = time.perf_counter()
        pending[-1].staging.result()
        pending[-1].upload.result()
        residual = time.perf_counter() - before
    seconds = time.perf_counter() - started
    out = {"seconds": seconds}
    if pending:
        save = pending[-1]
        deadline = time.monotonic() + 5  # the futures' callbacks stamp right after they resolve
        while (save.staged_at is None or save.durable_at is None) and time.monotonic() < deadline:
            time.sleep(0.001)
        out.update(blocking_s=save.returned - save.started, staged_s=(save.staged_at or save.returned) - save.started,
                   staging_wait_s=waited[0], durable_s=(save.durable_at or save.returned) - save.started,
                   upload_wait_s=residual)
    shutil.rmtree(path, ignore_errors=True)
    return out


def verify_nvme(trainer: Trainer, every: int, method: Method, path: str) -> bool:
    """An untimed segment: the checkpoint taken after step 1 loads back bit for bit as the
    values of that moment, although the loop went on training while it was copied and written."""
    expected: dict[str, torch.Tensor] = {}
    pending = []

    def wait() -> None:
        if pending:
            pending[0][0].result()

    for i in range(every):
        trainer.step(wait)
        if i == 0:
            state = trainer.state()
            expected = {f"model.{k}": v.detach().clone() for k, v in state["model"].items()}
            pending.append(method.save(state, path))
    pending[0][1].result()
    target = {"model": {k: torch.zeros_like(v) for k, v in trainer.model.state_dict().items()}}
    dcp.load(target, storage_reader=NVMeReader(path), no_dist=True)
    shutil.rmtree(path, ignore_errors=True)
    same = all(torch.equal(target["model"][k[len("model."):]], v) for k, v in expected.items())
    moved = any(not torch.equal(trainer.model.state_dict()[k[len("model."):]], v) for k, v in expected.items())
    return same and moved


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 6), "min": round(min(values), 6),
            "max": round(max(values), 6), "n": len(values)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=20, help="steps between checkpoints (default 20)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--methods", default="none,nvme,nvme_saver,dcp,torch_checkpointing",
                        help="comma-separated, from none,nvme,nvme_saver,dcp,torch_checkpointing")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(names) - {"none", *OURS, *PEERS})
    if unknown or "none" not in names:
        parser.error(f"--methods: 'none' plus any of {', '.join(OURS + PEERS)} (unknown: {unknown})")
    if args.every < 2 or args.rounds < 1:
        parser.error("--every >= 2 (the save overlaps the steps after it) and --rounds >= 1")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    if "torch_checkpointing" in names and importlib.util.find_spec("torch_checkpointing") is None:
        print("torch_checkpointing: not installed, skipped (pip install torch_checkpointing)")
        names.remove("torch_checkpointing")
    root = args.dir or tempfile.mkdtemp(prefix="dcp_nvme_train_")
    os.makedirs(root, exist_ok=True)

    trainer = Trainer(args.dim, args.layers, args.seq, args.batch)
    for _ in range(3):
        trainer.step()  # AdamW's moments exist from here on: the state's final structure
    state_bytes = sum(t.numel() * t.element_size() for group in trainer.state().values()
                      for t in _tensors(group))
    makers = {"nvme": NVMe, "nvme_saver": NVMeSaver, "dcp": DCPBest, "torch_checkpointing": TorchCheckpointing}
    methods: dict[str, Method | None] = {"none": None}
    for name in names:
        if name != "none":
            methods[name] = makers[name]()
    config = {"every": args.every, "rounds": args.rounds, "methods": names, "dim": args.dim,
              "layers": args.layers, "seq": args.seq, "batch": args.batch,
              "params": sum(p.numel() for p in trainer.model.parameters()), "state_bytes": state_bytes,
              "dir": root, "dcp_stager": dict(vars(dcp_best_options())),
              "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
              "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    print("configuration:", json.dumps(config))

    for name, method in methods.items():  # warm-up: arenas, caches, a writer process
        segment(trainer, args.every, method, os.path.join(root, f"warm_{name}"))
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in methods}
    order = list(methods)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[: r % len(order)]:
            rows[name].append(segment(trainer, args.every, methods[name], os.path.join(root, f"{name}_{r}")))
    verified = {name: verify_nvme(trainer, args.every, methods[name], os.path.join(root, f"verify_{name}"))
                for name in OURS if name in methods}
    for method in methods.values():
        if method is not None:
            method.close()

    config["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    base = [row["seconds"] for row in rows["none"]]
    results: dict[str, Any] = {"config": config, "methods": {}}
    for name, ok in verified.items():
        results[f"{name}_values_verified"] = ok
    for name, runs in rows.items():
        seconds = [row["seconds"] for row in runs]
        entry: dict[str, Any] = {"steps_per_s": round(args.every / statistics.median(seconds), 3),
                                 "segment_s": summary(seconds)}
        if name != "none":
            ratios = [(s - b) / b * 100 for s, b in zip(seconds, base)]
            entry["overhead_pct"] = summary(ratios)
            entry["overhead_pct_of_totals"] = round((sum(seconds) / sum(base) - 1) * 100, 3)
            for key in ("blocking_s", "staged_s", "staging_wait_s", "durable_s", "upload_wait_s"):
                entry[key] = summary([row[key] for row in runs])
        results["methods"][name] = entry
    results["vs_peers"] = vs_peers(results["methods"])
    print(format_report(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
        print("wrote", args.json)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return results


def vs_peers(methods: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Ours over each peer, medians: blocking and durable time ratios (< 1: ours is shorter),
    and the difference in overhead (percentage points of training time)."""
    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 4) if b > 0 else None

    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for ours in (m for m in OURS if m in methods):
        o = methods[ours]
        out[ours] = {peer: {"blocking_ratio": ratio(o["blocking_s"]["median"], p["blocking_s"]["median"]),
                            "durable_ratio": ratio(o["durable_s"]["median"], p["durable_s"]["median"]),
                            "overhead_pct_points": round(o["overhead_pct"]["median"] - p["overhead_pct"]["median"], 3)}
                     for peer, p in ((q, methods[q]) for q in PEERS if q in methods)}
    return out


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list):
        for v in value:
            yield from _tensors(v)


def format_report(results: dict[str, Any]) -> str:
    c = results["config"]
    lines = [f"state {c['state_bytes'] / 2**20:.1f} MiB ({c['params']} params + AdamW), a checkpoint every "
             f"{c['every']} steps, {c['rounds']} interleaved rounds, {c['torch_threads']} torch threads on "
             f"{c['cpus']} CPUs (load average {c['load_average_at_start'][0]} -> {c['load_average_at_end'][0]}); medians",
             f"{'method':<20}{'steps/s':>9}{'overhead %':>12}{'blocking ms':>13}{'staged ms':>11}"
             f"{'step waited ms':>16}{'durable ms':>12}"]
    for name, m in results["methods"].items():
        if name == "none":
            lines.append(f"{name:<20}{m['steps_per_s']:>9.2f}")
            continue
        lines.append(f"{name:<20}{m['steps_per_s']:>9.2f}{m['overhead_pct']['median']:>12.2f}"
                     f"{m['blocking_s']['median'] * 1e3:>13.2f}{m['staged_s']['median'] * 1e3:>11.1f}"
                     f"{m['staging_wait_s']['median'] * 1e3:>16.2f}{m['durable_s']['median'] * 1e3:>12.1f}")
    for ours, peers in results.get("vs_peers", {}).items():
        for peer, r in peers.items():
            blocking = "n/a" if r["blocking_ratio"] is None else f"{r['blocking_ratio']:.3f}x"
            durable = "n/a" if r["durable_ratio"] is None else f"{r['durable_ratio']:.3f}x"
            lines.append(f"{ours} / {peer}: blocking {blocking}, durable {durable}, "
                         f"overhead {r['overhead_pct_points']:+.2f} points")
    for ours in OURS:
        if results.get(f"{ours}_values_verified") is not None:
            lines.append(f"{ours} checkpoint = the values at its step: {results[f'{ours}_values_verified']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    sys.exit(0)
