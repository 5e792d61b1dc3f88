"""``python -m speedkit``: the ``speedkit`` command."""

from speedkit.frontend.cli import main

raise SystemExit(main())
