"""`python -m lit_interventions COMMAND ...` (and `torchrun ... -m lit_interventions COMMAND ...`):
the `lit-interventions` console script."""

import sys

from lit_interventions.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
