"""The modules a fresh interpreter holds before any user code: the start-up hook may add only its own module."""

import json
import sys

print(json.dumps(sorted(sys.modules)))
