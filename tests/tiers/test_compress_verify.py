"""``verify`` of a compressed mirror reports every damaged chunk, as it does every damaged block
of a plain checkpoint, instead of stopping at the first chunk that does not decode."""

from __future__ import annotations

import os

from test_compress import FAST, _dcz, make_state, save

from dcp_nvme.cli import main as cli_main
from dcp_nvme.tiers import DrainOptions, codec, drain
from dcp_nvme.tools.verify import verify_checkpoint


def _entries(blob: bytes) -> list[codec.Entry]:
    _, count, size, table_crc = codec.parse_header(blob[: codec.HEADER_SIZE])
    table = blob[codec.HEADER_SIZE: codec.HEADER_SIZE + count * codec.ENTRY_SIZE]
    return codec.parse_table(table, count, size, table_crc, len(blob))


def test_verify_lists_every_damaged_chunk_of_a_compressed_mirror(tmp_path, capsys):
    sd = make_state(23)
    local = save(tmp_path / "step_23", sd)
    target = str(tmp_path / "mirror")
    drain(local, target, options=DrainOptions(**FAST, compress="bytegroup"))
    assert verify_checkpoint(target).ok
    path = _dcz(target)
    blob = bytearray(open(path, "rb").read())
    entries = _entries(bytes(blob))
    assert len(entries) >= 3
    hit = [entries[1], entries[-1]]  # two chunks far apart, neither holding the header
    for entry in hit:
        blob[entry.stored_offset + entry.stored_length // 2] ^= 0xFF
    open(path, "wb").write(blob)

    report = verify_checkpoint(target, jobs=2)
    assert not report.ok
    data = [p for p in report.problems if p.kind == "data"]
    assert [(p.start, p.end) for p in data] == [(e.offset, e.end) for e in hit], report.problems
    plain = os.path.basename(path).removesuffix(".dcz")
    for problem, entry in zip(data, hit):
        assert problem.file == plain
        assert os.path.basename(path) in problem.message and f"chunk [{entry.offset}, {entry.end})" in problem.message
        assert problem.items, problem
    assert {p.kind for p in report.problems} <= {"data", "pickle"}  # nothing else is damaged
    # every byte outside the damaged chunks was still read and checked
    assert report.bytes_read >= sum(e.length for e in entries) - sum(e.length for e in hit)

    capsys.readouterr()
    assert cli_main(["verify", target]) != 0
    out = capsys.readouterr()
    text = out.out + out.err
    for entry in hit:
        assert f"chunk [{entry.offset}, {entry.end})" in text
