"""`python -m lit_interventions.syntaxgym ...`: see `lit_interventions.syntaxgym.cli`."""

import sys

from lit_interventions.syntaxgym.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
