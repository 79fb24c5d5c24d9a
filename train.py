"""Train and evaluate interventions: `python train.py fit --config configs/das.yaml`
(the same as `lit-interventions fit --config configs/das.yaml`).

LightningCLI gives `fit`, `validate` and `test`. A config names its LightningModule and
DataModule by `class_path` (CausalGym DAS, RAVEL DAS/MDAS/DBM/MDBM, AxBench dictionaries, SAE, ...).
`--model.lm` is shared with the data module, and so are `--model.region` (CausalGym) and
`--model.multitask` (RAVEL) where both classes take them, so each is given once.
See `lit_interventions.cli.commands` for what every run gets (run names, summaries, progress lines).
"""

from lit_interventions.cli.lightning import InterventionCLI, train_main
from lit_interventions.cli.parsing import first_reason
from lit_interventions.core.signals import stop_on_signals

__all__ = ["InterventionCLI", "first_reason", "main"]


def main(args=None):
    return train_main(args)


if __name__ == "__main__":
    with stop_on_signals():
        main()
