"""What the machine and the launcher give a process, below everything else: file primitives that
never follow links or block on FIFOs (``files``), and who this process is in the job (``job``:
torchrun's variables, the job's key-value store), work on a thread of its own (``threads``)."""
