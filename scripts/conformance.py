"""verl_ext's manager against veRL's own on the same servers, over the sampling settings users
run; JSON out (``verl_ext.verl_runs.conformance``). ``python scripts/conformance.py --quick --out DIR``."""

import sys

from verl_ext.verl_runs.conformance import main

if __name__ == "__main__":
    sys.exit(main())
