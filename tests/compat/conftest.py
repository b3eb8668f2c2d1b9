"""Third-party clients against real servers (`make compat`, its own virtualenv and extra)."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map

from tests.e2e.conftest import server, tool_server  # noqa: F401  (fixtures)
