"""deadpool-launch, the user's entry point (``python -m deadpool_ext.launch``
or the ``deadpool-launch`` command): the launcher lives in ``control.launch``."""

import sys

from deadpool_ext.control.launch import main

if __name__ == "__main__":
    sys.exit(main())
