"""Trainer integrations for dcp_nvme (Lightning, torchtitan, Megatron-Core).

Each submodule imports its trainer lazily, so importing
``dcp_nvme.integrations.<name>`` never fails when the trainer is absent.
"""
