"""The modules a fresh interpreter holds before any user code: the start-up hook may add only its shim, the package's
lazy top level and the import watcher."""

import json
import sys

print(json.dumps(sorted(sys.modules)))
