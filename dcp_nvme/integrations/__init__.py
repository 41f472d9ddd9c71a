"""Trainer integrations for dcp_nvme (Lightning, torchtitan, Megatron-Core).

Importing ``dcp_nvme`` or this package imports no trainer: only ``dcp_nvme.integrations.<name>``
imports its trainer, and raises an ImportError that names the package to install when the
trainer is absent. ``dcp_nvme.integrations.megatron`` also registers its strategies with
megatron-core at import (so Megatron's own tools find them). To find a run's checkpoints use
``dcp_nvme.checkpoints`` / ``dcp_nvme.latest``.
"""
