"""Trainer integrations for dcp_nvme (Lightning, torchtitan, Megatron-Core).

Importing ``dcp_nvme.integrations.<name>`` never fails when the trainer is absent: the
trainer-facing classes are built on first use. ``dcp_nvme.integrations.megatron`` also registers
its strategies with megatron-core at import when megatron-core is installed (so Megatron's own
tools find them). To find a run's checkpoints use ``dcp_nvme.checkpoints`` / ``dcp_nvme.latest``.
"""
