"""What ``dcp_nvme`` exports: the classes users call and the exceptions they catch; the other
exceptions live in ``dcp_nvme.errors`` only."""

from __future__ import annotations

import warnings

import pytest

import dcp_nvme
from dcp_nvme import errors

EXPORTED = ["CheckpointDir", "CheckpointExistsError", "CheckpointLockedError", "CheckpointNotCommittedError",
            "CheckpointNotFoundError", "ChecksumMismatchError", "DCPNVMeError", "IOConfig", "InvalidInputError",
            "NVMeAsyncSaver", "NVMeLoadPlanner", "NVMeReader", "NVMeStager", "NVMeWriter", "UnsafeItemError",
            "checkpoints", "latest"]

ERRORS_ONLY = ["BenchError", "BucketMissingError", "CodecError", "DrainError", "EngineUnavailableError",
         "ItemKindError", "ManifestError", "MissingDependencyError", "MissingItemError", "SaveError",
         "ShapeMismatchError", "StagingBusyError", "StorageError", "TableError", "UnknownOptionError",
         "UnsupportedItemError"]


def test_all_is_the_classes_users_call_and_the_exceptions_they_catch():
    assert sorted(dcp_nvme.__all__) == sorted(EXPORTED)
    for name in EXPORTED:
        assert getattr(dcp_nvme, name) is not None
    exceptions = [n for n in EXPORTED if isinstance(getattr(dcp_nvme, n), type)
                  and issubclass(getattr(dcp_nvme, n), BaseException)]
    assert all(getattr(dcp_nvme, n) is getattr(errors, n) for n in exceptions) and len(exceptions) == 8


@pytest.mark.parametrize("name", ERRORS_ONLY)
def test_an_exception_not_exported_is_imported_from_errors_only(name):
    """No alias kept at the top: nothing was released that imported them from there."""
    assert issubclass(getattr(errors, name), errors.DCPNVMeError)
    with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
        getattr(dcp_nvme, name)
    with pytest.raises(ImportError):
        exec(f"from dcp_nvme import {name}", {})
    assert name not in dir(dcp_nvme)


def test_star_import_gives_no_exception_of_errors_only():
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        exec("from dcp_nvme import *", namespace)
    assert not set(ERRORS_ONLY) & set(namespace)
    assert set(EXPORTED) <= set(namespace)


def test_every_exception_is_in_errors_and_either_exported_or_listed():
    defined = {n for n, v in vars(errors).items()
               if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == errors.__name__}
    exported = {n for n in EXPORTED if n in defined}
    assert set(ERRORS_ONLY) <= defined and not exported & set(ERRORS_ONLY)
    assert defined - exported - set(ERRORS_ONLY) <= {"LockFileError", "PeerError"}  # never exported
    with pytest.raises(AttributeError):
        dcp_nvme.NoSuchError  # noqa: B018
