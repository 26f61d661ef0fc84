"""Make the repository importable when `roofline` is not installed into the environment."""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import roofline.planner  # noqa: F401
except ImportError:
    sys.path.insert(0, _ROOT)
