"""Checkpoint directories: a local one (``local_dir``: list, read, atomic write, remove), one at
any fsspec URL (``fsspec_dir``), a run directory's committed steps (``run_dir``: ``latest``,
``checkpoints``), whether a committed checkpoint's files are all there (``intact``), and the
one-save-at-a-time lock of a directory (``save_lock``)."""
