"""host.job: the one place that reads torchrun's variables, with one rule for all of them."""

from __future__ import annotations

import os

import pytest

from dcp_nvme.errors import InvalidInputError
from dcp_nvme.host.job import launched_world_size, leads_its_node, local_rank, local_world_size, node_identity


def test_node_identity_is_the_node_rank_else_the_host_name():
    assert node_identity({"GROUP_RANK": "3"}) == "3"
    assert node_identity({}) == os.uname().nodename
    for bad in ("-1", "x", "1e3", "1" * 12):
        with pytest.raises(InvalidInputError, match="GROUP_RANK"):
            node_identity({"GROUP_RANK": bad})
    assert leads_its_node({"LOCAL_RANK": "0"}) and leads_its_node({}) and not leads_its_node({"LOCAL_RANK": "1"})


def test_local_world_size_wins_and_is_checked(monkeypatch):
    assert local_world_size(3) == 3 and local_world_size(None) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_world_size(3) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "zero")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='zero'"):
        local_world_size(3)


@pytest.mark.parametrize("name", ["LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_RANK"])
def test_every_launcher_variable_is_refused_by_name_when_it_is_not_a_count(name):
    """One rule for every variable: ``garbage`` is an error naming it, never a silent 1 or 0."""
    readers = {"LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world_size,
               "WORLD_SIZE": launched_world_size, "GROUP_RANK": node_identity}
    with pytest.raises(InvalidInputError, match=f"{name}='garbage'"):
        readers[name](environ={name: "garbage"})


def test_unset_or_empty_means_not_launched_that_way():
    assert local_rank(environ={}) is None and local_rank(environ={"LOCAL_RANK": " "}) is None
    assert local_world_size(environ={}) == 1 and local_world_size(2, environ={"LOCAL_WORLD_SIZE": ""}) == 2
    assert launched_world_size(environ={}) == 1 and launched_world_size(environ={"WORLD_SIZE": "8"}) == 8
    assert local_rank(environ={"LOCAL_RANK": "3"}) == 3
    with pytest.raises(InvalidInputError, match="WORLD_SIZE='0'"):
        launched_world_size(environ={"WORLD_SIZE": "0"})
