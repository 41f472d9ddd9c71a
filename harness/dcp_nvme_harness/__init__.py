"""dcp_nvme's test harness (not shipped with dcp_nvme): what the tests, the integration scenarios
and the benchmarks run on.

- ``multinode``: simulated nodes (namespaces, a disk each at one path), launched under torchrun
  or ``launch`` (torchrun's agent with forked workers); ``multinode_scripts``: what they run.
- ``netns``: a private network of shaped links; ``ports``: free ports.
- ``seaweed``: SeaweedFS (S3 and a FUSE mount); ``s3server``: moto behind a fault proxy;
  ``s3_fixtures``: pytest fixtures of the latter.
- ``dist_utils``: gloo process groups forked from a server that imported torch once.
- ``hostile_kit``, ``fake_sysfs``, ``cli_runs``, ``conformance_*``, ``drain_child``,
  ``scenarios``: the helpers of single suites.
"""
