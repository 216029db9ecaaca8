"""A Hermes runtime that records the modules a worker loaded after a turn.

python -m bench.sealed --record-modules puts this file alone on the workers'
path, as `hsb_sealed.py`, and starts a supervisor with `--agent
hsb_sealed:recording_hermes`: a worker imports it by that name, so it
imports nothing of bench/ (the standard library and hermes_sup only).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

RECORD_ENV = "HSB_RECORD_MODULES"


def recording_hermes(session: Any) -> Any:
    """A Hermes runtime that writes the worker's loaded modules to
    $HSB_RECORD_MODULES after each turn."""
    from hermes_sup.worker.hermes import HermesRuntime

    class Recording(HermesRuntime):  # type: ignore[misc]
        def run_turn(self, text: str, emit: Any, context: Any = None) -> Any:
            try:
                return super().run_turn(text, emit, context)
            finally:
                Path(os.environ[RECORD_ENV]).write_text("\n".join(sorted(sys.modules)) + "\n")

    return Recording(session)
