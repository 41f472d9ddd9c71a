"""One way to show a size and one way to draw a progress bar."""

from dcp_nvme.config import parse_size
from dcp_nvme.humanize import format_size, progress_bar


def test_format_size_uses_the_units_parse_size_reads():
    assert [format_size(n) for n in (None, 0, 312, 4096, 3 << 19, 8 << 20, 5 << 40)] == [
        "-", "0 B", "312 B", "4 KiB", "1.5 MiB", "8 MiB", "5 TiB"]
    assert parse_size(format_size(8 << 20).replace(" ", "")) == 8 << 20


def test_a_disabled_progress_bar_prints_nothing(capsys):
    bar = progress_bar(100, False, "verify")
    bar.update(40)
    bar.set_description("still quiet")
    bar.close()
    assert capsys.readouterr() == ("", "")


def test_an_enabled_progress_bar_draws_on_a_terminal_only_for_large_work(capsys, monkeypatch):
    from dcp_nvme import humanize

    for terminal, total, drawn in ((True, humanize.PROGRESS_MIN_BYTES, True), (False, humanize.PROGRESS_MIN_BYTES, False),
                                   (True, humanize.PROGRESS_MIN_BYTES - 1, False)):
        monkeypatch.setattr(humanize, "_is_terminal", lambda stream, t=terminal: t)
        bar = progress_bar(total, True, "export")
        bar.update(total)
        bar.close()
        out, err = capsys.readouterr()
        assert out == "" and ("export" in err) == drawn, (terminal, total, err)
