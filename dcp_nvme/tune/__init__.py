"""``dcp-nvme tune``: measure I/O points with the plugin's own engine (``probe``), for one rank
or a node's ranks at once (``ranks``), and store the best for every writer and reader
(``command``)."""
