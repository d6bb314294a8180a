"""``python -m jaxpr_rewrite {show,report,verify} module:function --args "f32[8,64] f32[64,32]"``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
