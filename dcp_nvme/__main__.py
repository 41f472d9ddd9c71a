"""``python -m dcp_nvme``: the ``dcp-nvme`` command."""

import sys

from dcp_nvme.cli import main

sys.exit(main())
