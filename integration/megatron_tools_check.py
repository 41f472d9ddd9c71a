"""Megatron's own checkpoint tools on a dcp_nvme checkpoint, in a process that never calls
``install()``: only ``import dcp_nvme.integrations.megatron``.

    python integration/megatron_tools_check.py CKPT_DIR      (an iter_N dir of megatron_scenario)

1. Before the import, Megatron cannot resolve the checkpoint's backend (``dcp_nvme``): this is
   the failure a Megatron tool meets without it.
2. After it, Megatron's ``get_default_load_sharded_strategy``, ``load_tensors_metadata`` and
   ``load_plain_tensors`` read the checkpoint through dcp_nvme.
3. ``remove_sharded_tensors(CKPT_DIR, "optim.")`` removes the optimizer items: they are gone from
   the metadata, the model tensors load bitwise as before, the directory shrinks, and it is
   still a committed dcp_nvme checkpoint. A prefix that matches nothing warns and changes
   nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main(ckpt: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import CheckpointingException
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    with tempfile.TemporaryDirectory() as tmp:  # Megatron's load wants a process group
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            _check(ckpt, torch, dist_checkpointing, CheckpointingException, get_default_load_sharded_strategy)
        finally:
            dist.destroy_process_group()
    print("megatron tools check OK")


def _check(ckpt, torch, dist_checkpointing, CheckpointingException, get_default_load_sharded_strategy):
    assert "dcp_nvme.integrations.megatron" not in sys.modules
    try:
        get_default_load_sharded_strategy(str(ckpt))
    except CheckpointingException as exc:
        assert "dcp_nvme" in str(exc), exc
    else:
        raise AssertionError("Megatron resolved backend dcp_nvme before the import registered it")

    import dcp_nvme.integrations.megatron as nv

    assert isinstance(get_default_load_sharded_strategy(str(ckpt)), nv.NVMeLoadShardedStrategy)
    keys = set(dist_checkpointing.load_tensors_metadata(str(ckpt)))
    assert {"model.w1", "model.w2", "optim.w1.exp_avg", "optim.step"} <= keys, keys
    before = dist_checkpointing.load_plain_tensors(str(ckpt))
    size_before = _dir_bytes(ckpt)

    dist_checkpointing.remove_sharded_tensors(str(ckpt), key_prefix="optim.")

    after_keys = set(dist_checkpointing.load_tensors_metadata(str(ckpt)))
    assert after_keys == {k for k in keys if not k.startswith("optim.")}, after_keys
    after = dist_checkpointing.load_plain_tensors(str(ckpt))
    for key in after_keys:
        assert torch.equal(before[key], after[key]), f"{key} changed by remove_sharded_tensors"
    assert _dir_bytes(ckpt) < size_before, (size_before, _dir_bytes(ckpt))
    assert (ckpt / "manifest.json").is_file() and (ckpt / "metadata.json").is_file()
    assert not [n for n in os.listdir(ckpt) if ".tmp-" in n]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist_checkpointing.remove_sharded_tensors(str(ckpt), key_prefix="no_such_key")
    assert any("nothing removed" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert set(dist_checkpointing.load_tensors_metadata(str(ckpt))) == after_keys


if __name__ == "__main__":
    main(Path(sys.argv[1]))
