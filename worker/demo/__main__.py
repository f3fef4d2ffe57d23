"""`python -m worker.demo OUTDIR`: write the demo model (worker/demo/model.py) into OUTDIR."""

import sys

from worker.demo.model import main

raise SystemExit(main(sys.argv[1:]))
