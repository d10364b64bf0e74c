"""``python -m mpexec``: the same as the ``mpexec`` command."""

from mpexec.cli import main

raise SystemExit(main())
