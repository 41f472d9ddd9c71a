"""What a save or a load measured and what it ran on: I/O statistics and phase timers
(``stats``), per-node telemetry of a save (``telemetry``), the Linux block layer under a directory
(``blockdev``), drive temperature and throttling (``drive_health``), and the page cache and
machine facts a benchmark reports (``machine``)."""
