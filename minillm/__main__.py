"""``python -m minillm``: the command-line interface (see ``minillm.tools.cli``)."""

from .tools.cli import main

raise SystemExit(main())
