"""The load path: ``NVMeReader`` (DCP's StorageReader) reads the manifest, plans each item's
byte ranges (``planning``), reads them through an engine straight into destination tensors,
verified, and decodes non-tensor items without running their code (``objects``); a compressed
mirror is read through ``tiers.coded`` (plugged in through ``dcp_nvme.seams``)."""
