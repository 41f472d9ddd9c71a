"""``python -m dcp_nvme``: the ``dcp-nvme`` command."""

import sys

from .cli import main

sys.exit(main())
