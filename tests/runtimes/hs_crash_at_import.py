"""A runtime module that kills its worker while being imported (exit status 3)."""

import os

os._exit(3)
