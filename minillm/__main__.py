"""``python -m minillm``: the command-line interface (see ``minillm.cli``)."""

from .cli import main

raise SystemExit(main())
