"""Other nodes' disks as copies of a node-local checkpoint (optional: plugged into the core through
``dcp_nvme.seams``): replicas sent in the background after a commit over a gloo group of their own
(``replicate``), a load on several ranks that takes what its node lacks from the other nodes over
another (``exchange``), a load in one process that takes each file from the nearest copy that
verifies -- a replica here, the mirror (``sources``) -- and the verified copy itself
(``fetching``); the restore a reader holds, either way (``restore``, plugged into
``seams.restore``), and what it keeps of what came (``kept``). No server of ours listens: the
job's own connections carry every byte."""
