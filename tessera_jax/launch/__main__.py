"""``python -m tessera_jax.launch``: the process launcher (``process.py``)."""

import sys

from tessera_jax.launch.process import main

sys.exit(main())
