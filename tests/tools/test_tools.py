"""dcp_nvme.tools and `dcp-nvme list | inspect | verify | export` on real checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from dcp_nvme_harness.warm import warm_python
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import NVMeWriter
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.format.manifest import read_files, read_manifest
from dcp_nvme.storage.local_dir import LocalStore
from dcp_nvme.storage.run_dir import parse_step
from dcp_nvme.tools import export_hf, inspect_checkpoint, list_checkpoints, verify_checkpoint
from dcp_nvme.tools.consolidate import chunk_needs, plan_shards

REPO = Path(__file__).resolve().parents[2]


def save(path: Path, state: dict) -> Path:
    dcp.save(state, storage_writer=NVMeWriter(path, direct_io=False), no_dist=True)
    return path


def sample_state() -> dict:
    torch.manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(64, 32),
            "layer.0.weight": torch.randn(32, 32, dtype=torch.bfloat16),
            "layer.0.bias": torch.randn(32),
            "scale": torch.tensor(3.0),
            "steps": torch.arange(10, dtype=torch.int64),
        },
        "optim": {"state": {"lr": torch.full((32,), 0.1)}, "note": "step 10"},
    }


def cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m dcp_nvme.cli ARGS``, forked from the warm server (torch imported once)."""
    done = warm_python().run(["-m", "dcp_nvme.cli", *args], cwd=REPO, timeout=120)
    return subprocess.CompletedProcess(list(args), done.returncode, done.stdout, done.stderr)


def cli_many(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """Several CLI runs at once."""
    with ThreadPoolExecutor(len(argvs)) as pool:
        return list(pool.map(lambda argv: cli(*argv), argvs))


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def only(directory: Path, prefix: str) -> Path:
    (found,) = [p for p in directory.iterdir() if p.name.startswith(prefix)]
    return found


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return save(tmp_path / "step_10", sample_state())


# --------------------------------------------------------------------------- list


def test_parse_step():
    assert parse_step("step_1000") == 1000
    assert parse_step("step-20") == 20
    assert parse_step("300") == 300
    assert parse_step("checkpoint-7") == 7
    assert parse_step("global_step42") == 42
    assert parse_step("final") is None


def test_list_newest_first_with_states(tmp_path: Path):
    run = tmp_path / "run"
    for step in (100, 2000, 300):
        save(run / f"step_{step}", sample_state())
    shutil.copytree(run / "step_300", run / "step_400")
    (run / "step_400" / MANIFEST).unlink()  # a save that never committed
    shutil.copytree(run / "step_300", run / "step_500")
    flip(only(run / "step_500", "index."), 40)
    shutil.copytree(run / "step_300", run / "step_600")
    only(run / "step_600", "rank_").unlink()  # committed, then a file was lost
    (run / "logs").mkdir()  # not a checkpoint: not listed
    (run / "step_700").mkdir()  # a save killed before its first file: listed, as incomplete
    (run / "step_700" / ".save.lock").write_text("{}")
    # a save into the run directory itself would hide its steps: refused, naming them
    with pytest.raises(CheckpointException, match=f"{run} holds checkpoints in directories \\(step_100, step_2000, "
                                                "step_300 and 2 more\\): it is a run directory.*step_000100"):
        save(run, sample_state())
    assert not (run / MANIFEST).exists()

    entries = list_checkpoints(run)
    assert [e.step for e in entries] == [2000, 700, 600, 500, 400, 300, 100]
    states = {e.step: e.state for e in entries}
    assert states == {2000: "committed", 700: "incomplete", 600: "damaged", 500: "corrupt", 400: "incomplete",
                      300: "committed", 100: "committed"}
    by_step = {e.step: e for e in entries}
    assert "did not finish" in by_step[400].reason
    assert "empty step directory: a save there stopped (or was killed) before it wrote a file" in by_step[700].reason
    assert "index" in by_step[500].reason
    assert "missing" in by_step[600].reason
    assert by_step[2000].ranks == 1 and by_step[400].ranks == 1
    assert by_step[2000].bytes == sum(p.stat().st_size for p in (run / "step_2000").iterdir())

    as_json, as_text = cli_many(["list", str(run), "--json"], ["list", str(run)])
    assert as_json.returncode == 0, as_json.stderr
    rows = json.loads(as_json.stdout)
    assert [r["step"] for r in rows] == [2000, 700, 600, 500, 400, 300, 100]
    assert as_text.returncode == 0 and "incomplete" in as_text.stdout and "did not finish" in as_text.stdout


# --------------------------------------------------------------------------- inspect


def test_inspect_committed(ckpt: Path):
    info = inspect_checkpoint(ckpt)
    assert info.ok and info.world_size == 1
    tensors = {t.fqn: t for t in info.tensors}
    assert set(tensors) == {"model.embed.weight", "model.layer.0.weight", "model.layer.0.bias",
                            "model.scale", "model.steps", "optim.state.lr"}
    assert tensors["model.layer.0.weight"].dtype == "bfloat16"
    assert tensors["model.layer.0.weight"].shape == (32, 32)
    assert tensors["model.layer.0.weight"].nbytes == 32 * 32 * 2
    assert tensors["model.scale"].shape == ()
    assert [o.fqn for o in info.objects] == ["optim.note"]
    assert info.by_dtype["bfloat16"] == 2048
    assert info.by_dtype["float32"] == (64 * 32 + 32 + 1 + 32) * 4
    assert info.by_top_key["optim"] == 32 * 4 + info.objects[0].nbytes
    assert info.total_bytes == sum(info.by_top_key.values())

    only_model = inspect_checkpoint(ckpt, filter="model.layer.*")
    assert {t.fqn for t in only_model.tensors} == {"model.layer.0.weight", "model.layer.0.bias"}
    with pytest.raises(ValueError, match="matches"):
        inspect_checkpoint(ckpt, filter="nothing.*")

    as_json, as_text = cli_many(["inspect", str(ckpt), "--json"], ["inspect", str(ckpt)])
    assert as_json.returncode == 0, as_json.stderr
    assert {t["fqn"] for t in json.loads(as_json.stdout)["tensors"]} == set(tensors)
    assert as_text.returncode == 0 and "model.layer.0.weight" in as_text.stdout
    assert "by top key" in as_text.stdout


def test_inspect_incomplete_and_corrupt(ckpt: Path, tmp_path: Path):
    incomplete = tmp_path / "incomplete"
    shutil.copytree(ckpt, incomplete)
    (incomplete / MANIFEST).unlink()
    info = inspect_checkpoint(incomplete)
    assert info.state == "incomplete" and "did not finish" in info.reason
    (name, desc), = info.partial.items()
    assert name.startswith("rank_00000.") and desc["items"] == 7  # 6 tensors + 1 object


    corrupt = tmp_path / "corrupt"
    shutil.copytree(ckpt, corrupt)
    (corrupt / MANIFEST).write_text('{"format": "dcp_nvme", "format_versi')
    info = inspect_checkpoint(corrupt)
    assert info.state == "corrupt" and "not valid JSON" in info.reason
    first, second = cli_many(["inspect", str(incomplete)], ["inspect", str(corrupt)])
    assert first.returncode == 1 and "Traceback" not in first.stderr
    assert "incomplete" in first.stdout and "did not finish" in first.stdout
    assert second.returncode == 1 and "not valid JSON" in second.stdout and "Traceback" not in second.stderr


# --------------------------------------------------------------------------- verify


def test_verify_intact(ckpt: Path):
    report = verify_checkpoint(ckpt, jobs=2)
    assert report.ok, report.problems
    container = only(ckpt, "rank_")
    assert report.bytes_read == container.stat().st_size



def _big_ckpt(tmp_path: Path) -> Path:
    torch.manual_seed(1)
    # checksum blocks are 1 MiB: several tensors over several blocks
    state = {f"w{i}": torch.randn(300_000) for i in range(4)}
    return save(tmp_path / "big", state)


def test_verify_names_item_and_range_of_a_flipped_data_byte(tmp_path: Path):
    ckpt = _big_ckpt(tmp_path)
    manifest = read_manifest(LocalStore(ckpt), str(ckpt))
    (w2,) = [c for c in manifest.chunks if c.fqn == "w2"]
    record = read_files(LocalStore(ckpt), manifest, str(ckpt))[w2.file]
    container = ckpt / w2.file
    offset = w2.byte_offset + w2.length // 2
    flip(container, offset)
    block = record.checksum_block
    start = record.data_start + (offset - record.data_start) // block * block
    for jobs in (1, 3):
        report = verify_checkpoint(ckpt, jobs=jobs, span=2 * block)
        assert not report.ok
        (problem,) = report.problems
        assert problem.file == w2.file and problem.kind == "data"
        assert (problem.start, problem.end) == (start, start + block)
        assert problem.items == ("w2",)
    intact = tmp_path / "intact"
    save(intact, {"x": torch.ones(10)})
    bad, good = cli_many(["verify", str(ckpt)], ["verify", str(intact), "--jobs", "2"])
    assert bad.returncode == 1 and "FAILED" in bad.stdout
    assert f"BAD {w2.file} bytes [{problem.start}, {problem.end})" in bad.stdout and "w2" in bad.stdout
    assert "\r" not in bad.stderr and "verify:" not in bad.stderr  # a pipe gets no progress bar
    assert good.returncode == 0 and good.stdout.startswith("OK") and "GB/s" in good.stdout


def test_verify_reports_every_bad_block(tmp_path: Path):
    ckpt = _big_ckpt(tmp_path)
    container = only(ckpt, "rank_")
    files = read_files(LocalStore(ckpt), read_manifest(LocalStore(ckpt), str(ckpt)), str(ckpt))
    record = files[container.name]
    first, last = record.data_start + 10, record.size - 10
    flip(container, first)
    flip(container, last)
    report = verify_checkpoint(ckpt, jobs=2)
    spans = [(p.start, p.end) for p in report.problems]
    assert len(spans) == 2
    assert spans[0][0] <= first < spans[0][1] and spans[1][0] <= last < spans[1][1]
    assert report.problems[0].items == ("w0",) and report.problems[1].items == ("w3",)


def _flip_container_header(ckpt: Path) -> None:
    container = only(ckpt, "rank_")
    flip(container, 100)  # inside the JSON header


def _flip_index(ckpt: Path) -> None:
    flip(only(ckpt, "index."), 60)


def _flip_blocks(ckpt: Path) -> None:
    path = only(ckpt, "blocks.")
    flip(path, path.stat().st_size // 2)


def _truncate(ckpt: Path) -> None:
    container = only(ckpt, "rank_")
    os.truncate(container, container.stat().st_size - 5000)


def _remove(ckpt: Path) -> None:
    only(ckpt, "rank_").unlink()


@pytest.mark.parametrize("damage, culprit, kind", [
    (_flip_container_header, "rank_", "header"),
    (_flip_index, "index.", "index"),
    (_flip_blocks, "blocks.", "blocks"),
    (_truncate, "rank_", "size"),
    (_remove, "rank_", "missing"),
])
def test_verify_catches_damage(ckpt: Path, damage, culprit, kind):
    damage(ckpt)
    report = verify_checkpoint(ckpt)
    assert not report.ok
    assert any(p.file.startswith(culprit) and p.kind == kind for p in report.problems), report.problems


def test_verify_truncation_names_unreadable_blocks(tmp_path: Path):
    ckpt = _big_ckpt(tmp_path)
    _truncate(ckpt)
    report = verify_checkpoint(ckpt)
    kinds = {p.kind for p in report.problems}
    assert kinds == {"size", "data"}
    (data,) = [p for p in report.problems if p.kind == "data"]
    assert "ends before" in data.message and data.items == ("w3",)


def test_verify_catches_any_flipped_manifest_byte(ckpt: Path):
    path = ckpt / MANIFEST
    original = path.read_bytes()
    positions = sorted({0, 1, len(original) - 1, *range(7, len(original), max(1, len(original) // 25))})
    for offset in positions:
        flip(path, offset)
        report = verify_checkpoint(ckpt)
        assert not report.ok, f"flip at {offset} went unnoticed"
        assert report.problems[0].file == MANIFEST
        path.write_bytes(original)
    assert verify_checkpoint(ckpt).ok


@pytest.mark.parametrize("field, value", [
    ("total_bytes", 1), ("world_size", 0), ("save_key", "00000000"),
])
def test_verify_catches_edited_manifest_fields(ckpt: Path, field, value):
    path = ckpt / MANIFEST
    doc = json.loads(path.read_text())
    doc[field] = value
    path.write_text(json.dumps(doc))
    assert not verify_checkpoint(ckpt).ok


def test_verify_catches_edited_file_size_in_manifest(ckpt: Path):
    path = ckpt / MANIFEST
    doc = json.loads(path.read_text())
    doc["files"][0]["size"] += 1
    path.write_text(json.dumps(doc))
    report = verify_checkpoint(ckpt)
    assert any(p.kind == "manifest" and "own checksum" in p.message for p in report.problems)


def test_verify_over_an_fsspec_url(ckpt: Path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.put(str(ckpt), "/bucket/step_10", recursive=True)
    try:
        assert verify_checkpoint("memory://bucket/step_10", jobs=2).ok
        name = only(ckpt, "rank_").name
        data = bytearray(fs.cat_file(f"/bucket/step_10/{name}"))
        data[-3] ^= 0xFF
        fs.pipe_file(f"/bucket/step_10/{name}", bytes(data))
        report = verify_checkpoint("memory://bucket/step_10")
        (problem,) = report.problems
        assert problem.kind == "data" and problem.end == len(data)
        assert problem.items[-1] == "optim.note"  # the last item; one checksum block holds them all
        assert inspect_checkpoint("memory://bucket/step_10").ok
    finally:
        fs.rm("/bucket", recursive=True)


# --------------------------------------------------------------------------- export: pure planning


def test_chunk_needs_place_a_column_shard(tmp_path: Path):
    from dcp_nvme.format.tables import ChunkRecord

    full = torch.arange(6 * 8, dtype=torch.int32).reshape(6, 8)
    part = full[:, 4:8].contiguous()  # a column shard: one run per row
    chunk = ChunkRecord("t", "tensor", (0, 4), (6, 4), (6, 8), "int32", "f", 1000, part.nbytes, "t@0,4")
    rebuilt = torch.zeros(6 * 8 * 4, dtype=torch.uint8)
    source = part.reshape(-1).view(torch.uint8)
    groups = list(chunk_needs(chunk, 4, 0, max_runs=4))
    assert [len(g) for g in groups] == [4, 2]  # planned 4 rows at a time
    for group in groups:
        for need in group:
            rel = need.file_offset - 1000
            rebuilt[need.dest_offset : need.dest_offset + need.length] = source[rel : rel + need.length]
    assert torch.equal(rebuilt.view(torch.int32).reshape(6, 8)[:, 4:], part)


def test_plan_shards_like_transformers():
    from dcp_nvme.tools.consolidate import TensorPlan

    def plan(name, n):
        return TensorPlan(name, name, torch.float32, torch.float32, (n,), ())

    shards = plan_shards([plan("a", 10), plan("b", 10), plan("c", 30), plan("d", 5)], 100)
    assert [[t.name for t in s] for s in shards] == [["a", "b"], ["c"], ["d"]]


# --------------------------------------------------------------------------- export


def _read_export(out: Path) -> tuple[dict, dict]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded = load_file(out / shard)
        assert not set(loaded) & set(tensors), "a key is in two shards"
        tensors.update(loaded)
        for key in loaded:
            assert index["weight_map"][key] == shard
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    return index, tensors


def test_export_single_rank_with_dtype_and_shards(ckpt: Path, tmp_path: Path):
    out = tmp_path / "hf"
    result = export_hf(ckpt, out, keys="model.*", strip_prefix="model.", dtype="fp16", max_shard_size="6kB")
    index, tensors = _read_export(out)
    expected = sample_state()["model"]
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        if value.is_floating_point():
            assert tensors[name].dtype == torch.float16
            assert torch.equal(tensors[name], value.to(torch.float16)), name
        else:
            assert tensors[name].dtype == value.dtype and torch.equal(tensors[name], value)
    assert len(result.shards) == len(set(index["weight_map"].values())) == 2
    assert result.shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == [*result.shards, "model.safetensors.index.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]  # no leftover temp dir


def test_export_unstorable_dtype(tmp_path: Path):
    e8m0 = torch.tensor([1.0, 2.0, 0.5, 8.0]).to(torch.float8_e8m0fnu)
    ckpt = save(tmp_path / "c", {"scales": e8m0, "w": torch.ones(3)})
    with pytest.raises(ValueError, match=r"cannot store the dtype.*scales.*--dtype"):
        export_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_hf(ckpt, tmp_path / "out", dtype="fp32")
    _, tensors = _read_export(tmp_path / "out")
    assert torch.equal(tensors["scales"], e8m0.to(torch.float32))


@pytest.mark.slow
def test_bad_arguments_give_one_line_cli(ckpt: Path, tmp_path: Path):
    out, nope, empty = tmp_path / "out", str(tmp_path / "nope"), tmp_path / "empty"
    empty.mkdir()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    runs = cli_many(
        ["export", nope, "--to", "hf", str(tmp_path / "o1")],
        ["export", str(empty), "--to", "hf", str(tmp_path / "o1")],
        ["export", str(ckpt), "--to", "hf", str(tmp_path / "o1"), "--keys", "decoder.*"],
        ["export", str(ckpt), "--to", "hf", str(out)],
        ["export", str(ckpt), "--to", "hf", str(tmp_path / "o1"), "--dtype", "fp7"],
        ["inspect", nope],
        ["inspect", str(ckpt), "--filter", "zzz*"],
        ["verify", str(empty)],
        ["list", nope],
        ["export", str(ckpt), "--to", "hf", str(tmp_path / "o3"), "--no-progress", "--include-optimizer"],
    )
    expected = [("does not exist",), ("not a dcp_nvme checkpoint",), ("decoder.*", "matches no tensor"),
                ("already exists",), ("unknown --dtype",), ("does not exist",), ("matches",),
                ("not a dcp_nvme checkpoint",), ("does not exist",)]
    for proc, words in zip(runs, expected):
        assert_one_line_error(proc, *words)
    assert (out / "keep.txt").read_text() == "mine" and not (tmp_path / "o1").exists()
    ok = runs[-1]
    assert ok.returncode == 0 and "exported 6 tensor(s)" in ok.stdout and "optim.note" in ok.stdout


# --------------------------------------------------------------------------- export: FSDP2, 2 ranks


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(37, 12)  # 37 rows: an uneven split over 2 ranks
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(12, 12) for _ in range(2))
        self.head = torch.nn.Linear(12, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _save_fsdp2(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    model = _Net()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.arange(8)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    # other shardings: by columns, and along the last dim of a 3-d tensor
    torch.manual_seed(1)
    cols, cube = torch.randn(6, 10), torch.randn(3, 4, 9)
    extra = {"cols": distribute_tensor(cols, mesh, [Shard(1)]), "cube": distribute_tensor(cube, mesh, [Shard(2)])}
    dcp.save({"model": msd, "optim": osd, "extra": extra}, storage_writer=NVMeWriter(path, direct_io=False))


@pytest.mark.slow
def test_export_fsdp2_two_ranks_equals_unsharded(tmp_path: Path):
    ckpt = tmp_path / "fsdp"
    run_ranks(2, _save_fsdp2, str(ckpt))
    torch.manual_seed(0)
    reference = _Net()  # the same init, unsharded; one Adam step on the same batch
    optim = torch.optim.Adam(reference.parameters(), lr=0.1)
    reference(torch.arange(8)).sum().backward()
    optim.step()
    info = inspect_checkpoint(ckpt)
    assert info.world_size == 2
    assert {t.fqn: t.shards for t in info.tensors}["model.embed.weight"] == 2
    assert verify_checkpoint(ckpt).ok

    out = tmp_path / "hf"
    export_hf(ckpt, out, keys=["model.*"], strip_prefix="model.")
    _, tensors = _read_export(out)
    expected = reference.state_dict()
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        assert torch.allclose(tensors[name], value, atol=1e-6, rtol=0), name

    torch.manual_seed(1)
    cols, cube = torch.randn(6, 10), torch.randn(3, 4, 9)
    export_hf(ckpt, tmp_path / "extra", keys="extra.*", strip_prefix="extra.")
    _, extra = _read_export(tmp_path / "extra")
    assert torch.equal(extra["cols"], cols) and torch.equal(extra["cube"], cube)

    export_hf(ckpt, tmp_path / "optim", keys="optim.state.*")
    _, optim_out = _read_export(tmp_path / "optim")
    for name, param in reference.named_parameters():
        assert torch.allclose(optim_out[f"optim.state.{name}.exp_avg"], optim.state[param]["exp_avg"],
                              atol=1e-6, rtol=0), name


# --------------------------------------------------------------------------- export: memory bound

_MEASURE = textwrap.dedent("""
    import json, sys
    from dcp_nvme.format.manifest import read_files, read_manifest
    from dcp_nvme.storage.local_dir import LocalStore
    from dcp_nvme.tools import export_hf

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    # reading Parquet once costs ~55 MiB (pyarrow's pools), whatever the checkpoint's size
    store = LocalStore(sys.argv[1])
    read_files(store, read_manifest(store, sys.argv[1]), sys.argv[1])
    before = status("VmRSS:")
    result = export_hf(sys.argv[1], sys.argv[2], dtype=sys.argv[3] if len(sys.argv) > 3 else None)
    print(json.dumps({"before": before, "hwm": status("VmHWM:"), "largest": result.largest_tensor}))
""")


@pytest.mark.slow
def test_export_peak_memory_is_bounded_by_the_largest_tensor(tmp_path: Path):
    torch.manual_seed(2)
    tensor_bytes = 8 << 20
    ckpt = save(tmp_path / "c", {f"layer{i}.weight": torch.randn(tensor_bytes // 4) for i in range(40)})
    model_bytes = 40 * tensor_bytes
    fixed = 32 << 20  # cast buffer (16 MiB), read scratch, interpreter churn
    for extra in ([], ["bf16"]):
        out = tmp_path / f"hf{len(extra)}"
        proc = subprocess.run([sys.executable, "-c", _MEASURE, str(ckpt), str(out), *extra],
                              capture_output=True, text=True, cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stderr
        figures = json.loads(proc.stdout)
        growth = figures["hwm"] - figures["before"]
        print(f"export {extra or 'same dtype'}: peak RSS growth {growth / 2**20:.1f} MiB for a "
              f"{model_bytes / 2**20:.0f} MiB model (largest tensor {figures['largest'] / 2**20:.0f} MiB)")
        assert figures["largest"] == tensor_bytes
        assert growth < tensor_bytes + fixed < model_bytes / 4
        _, tensors = _read_export(out)
        assert len(tensors) == 40


# --------------------------------------------------------------------------- export: transformers


@pytest.mark.slow
def test_export_loads_in_transformers_with_same_logits(tmp_path: Path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ckpt = save(tmp_path / "step_1", {"model": model.state_dict()})
    out = tmp_path / "hf"
    export_hf(ckpt, out, keys="model.*", strip_prefix="model.")
    config.save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
