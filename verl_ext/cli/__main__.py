import sys

from verl_ext.cli import main

sys.exit(main())
