"""The modules a fresh interpreter holds before any user code: the start-up hook must add only itself."""

import json
import sys

print(json.dumps(sorted(sys.modules)))
