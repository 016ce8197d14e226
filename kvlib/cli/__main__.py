"""``python -m kvlib.cli``: the ``kvlib`` command, for when the script is not on the PATH."""
import sys

from kvlib.cli.commands import main

sys.exit(main())
