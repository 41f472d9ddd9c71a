"""Other nodes' disks as copies of a node-local checkpoint (optional: plugged into the core through
``dcp_nvme.seams``): replicas pulled in the background after a commit (``replicate``), the byte
server each node runs and its client (``server``, ``client``), and a load that takes each file
from the nearest copy that verifies (``sources``)."""
