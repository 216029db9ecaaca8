"""A module that holds up the zygote's preload until the test lets it go:
imported with `--preload hs_slow_preload`, it waits for the file named by
HS_RELEASE (a supervisor start as long as the test wants, as the sealed
Hermes preload is on a slow machine). Never more than five minutes."""

import os
import time

_release = os.environ.get("HS_RELEASE")
_deadline = time.monotonic() + 300
while _release and not os.path.exists(_release) and time.monotonic() < _deadline:
    time.sleep(0.05)
