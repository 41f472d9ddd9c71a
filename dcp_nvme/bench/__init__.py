"""``dcp-nvme bench``: dcp_nvme beside the device limit and the usual ways to save, in one run.

One synthetic Llama-shaped state (``dcp_nvme.bench.synthetic``), one directory, one process per rank:

- the device limit: fio sequential O_DIRECT write and read at the plugin's queue depth and block
  size (the plugin's own engine on an aligned buffer when fio is not installed), and a
  memory-copy floor (memmove into prefaulted memory: what staging a copy costs at best);
- dcp_nvme: sync save, cold load, async save (blocking and total), a resharded load;
- peers: DCP's FileSystemWriter (thread_count 1, 2, 4, 8) and FileSystemReader, torch.save and
  torch.load, safetensors save_file and load_file.

Every save goes to a fresh directory (new files, as real checkpoints are; overwriting a big file
costs the filesystem extra). Saves include fsync for every writer, so all are durable. Before a
load the checkpoint's files are evicted from the page cache (fsync + posix_fadvise DONTNEED:
unprivileged, and only those files) and the report says how, and what share of pages a sampled
non-blocking read still found cached. Every save and load runs once untimed on a 1 MiB state
first, so imports and one-time set-up stay out of the rows.
"""

# The package's modules, one job each: cli (arguments, the command), runner (the steps on every
# rank, the results document, the processes over gloo), rows (dcp_nvme's rows, the warm-up, the
# memory-copy floor and the device limit), peers (FileSystemWriter/Reader, torch.save/load,
# safetensors), core (what every row shares), group (collectives), device (fio), reshard (the
# resharded load's planner), records (options and rows), targets (ratios and targets), report (the
# printed table), plot (the chart). The docstring above is the command's --help description.

from dcp_nvme.bench.cli import register
from dcp_nvme.bench.device import fio_sequential, fio_version
from dcp_nvme.bench.group import Group
from dcp_nvme.bench.records import BenchOptions, Row, Skip
from dcp_nvme.bench.report import format_report
from dcp_nvme.bench.reshard import RESHARD_SPLIT, reshard_rows
from dcp_nvme.bench.runner import Bench, run_bench
from dcp_nvme.bench.targets import TARGETS, check_targets, compute_ratios

__all__ = [
    "RESHARD_SPLIT", "TARGETS", "Bench", "BenchOptions", "Group", "Row", "Skip", "check_targets",
    "compute_ratios", "fio_sequential", "fio_version", "format_report", "register", "reshard_rows", "run_bench",
]
