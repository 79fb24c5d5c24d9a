"""Train and evaluate interventions: `python train.py fit --config configs/das.yaml`.

LightningCLI gives `fit`, `validate` and `test`; `--model.lm` and `--model.region` are shared
with the data module, so each is given once.
"""

import sys

from lightning.pytorch.cli import LightningCLI

from datamodules.causalgym import CausalGymDataModule
from lit_interventions.callbacks.export import ExportIntervention
from lit_interventions.modules.interchange import InterchangeModule


class InterventionCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("model.lm", "data.lm")
        parser.link_arguments("model.region", "data.region")

    def instantiate_classes(self):
        """Bad input (unknown task, region, layer, file) is one line on stderr, not a traceback."""
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError, ImportError) as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from err


def main(args=None):
    return InterventionCLI(
        InterchangeModule,
        CausalGymDataModule,
        trainer_defaults={"callbacks": [ExportIntervention()]},
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
