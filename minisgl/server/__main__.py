"""`python -m minisgl.server --model PATH ...`: the same as `python -m minisgl serve ...`."""

import sys

from minisgl.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
