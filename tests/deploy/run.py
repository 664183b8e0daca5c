#!/usr/bin/env python3
"""ctest entry point for tests/deploy: runs test_deploy.py with pytest.

Exits 77 (ctest's SKIP_RETURN_CODE for this test) with the reason printed when a Python
package the tests need is absent; scripts/test.sh installs them (pytest, pyyaml,
kubernetes-validate, promql-parser). Any other outcome is pytest's own exit status.
"""
import importlib.util
import os
import sys

NEEDED = {"pytest": "pytest", "yaml": "pyyaml", "kubernetes_validate": "kubernetes-validate",
          "jsonschema": "jsonschema", "promql_parser": "promql-parser"}

missing = [pkg for mod, pkg in NEEDED.items() if importlib.util.find_spec(mod) is None]
if missing:
    print("SKIPPED: tests/deploy needs the Python packages %s (pip install %s)" % (
        ", ".join(missing), " ".join(missing)))
    sys.exit(77)

import pytest  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", os.path.join(here, "test_deploy.py"),
                      *sys.argv[1:]]))
