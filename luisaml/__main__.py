"""`python -m luisaml ...`: the command line of luisaml/cli.py."""
import sys

from .cli import main

sys.exit(main())
