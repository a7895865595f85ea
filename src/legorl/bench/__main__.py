"""`python -m legorl.bench`: see `legorl.bench`."""

from legorl.bench import main

raise SystemExit(main())
