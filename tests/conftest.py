import os
import sys

# tests import their helpers (dist_utils, s3server...) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))
