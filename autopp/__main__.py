"""``python -m autopp``: the ``autopp`` command line (:mod:`autopp.cli`)."""

from autopp.cli import main

raise SystemExit(main())
