"""Train and evaluate interventions: `python train.py fit --config configs/das.yaml`.

LightningCLI gives `fit`, `validate` and `test`. A config names its LightningModule and
DataModule by `class_path` (CausalGym DAS, RAVEL DAS/MDAS/DBM/MDBM, AxBench dictionaries, ...).
`--model.lm` is shared with the data module, and so are `--model.region` (CausalGym) and
`--model.multitask` (RAVEL) where both classes take them, so each is given once.
"""

import sys

from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningCLI

from lit_interventions.callbacks.dictionary import ExportDictionary
from lit_interventions.callbacks.export import ExportIntervention

def _first_reason(message: str) -> str:
    """The first specific reason in a jsonargparse error (it lists one per type it tried, and the
    detail of a reason on the lines indented below it)."""
    lines = message.strip().splitlines()
    for i, line in enumerate(lines):
        text = line.strip()
        if text.startswith("- ") and not text.startswith("- Expected a <class 'NoneType'>"):
            indent = len(line) - len(line.lstrip())
            detail = [d.strip() for d in lines[i + 1 :] if len(d) - len(d.lstrip()) > indent + 2]
            stop = next((j for j, d in enumerate(lines[i + 1 :]) if len(d) - len(d.lstrip()) <= indent + 2), len(detail))
            return " ".join([text[2:], *detail[:stop]])
    return " ".join(line.strip() for line in lines[:2])


SHARED = ("lm", "region", "multitask")  # model init args the data module also takes


class InterventionCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        for name in SHARED:  # a link whose target class lacks the argument is skipped
            parser.link_arguments(f"model.init_args.{name}", f"data.init_args.{name}")

    def init_parser(self, **kwargs):
        return super().init_parser(**kwargs, exit_on_error=False)  # subcommand parsers too

    def parse_arguments(self, parser, args):
        """A bad value found while parsing (the data module validates its task when the parser
        checks the class) is one line on stderr, as in `instantiate_classes`."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            print(f"error: {_first_reason(str(err))}", file=sys.stderr)
            raise SystemExit(2) from err

    def instantiate_classes(self):
        """Bad input (unknown task, region, layer, file) is one line on stderr, not a traceback."""
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError, ImportError) as err:
            print(f"error: {_first_reason(str(err))}", file=sys.stderr)
            raise SystemExit(2) from err


def main(args=None):
    return InterventionCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"callbacks": [ExportIntervention(), ExportDictionary()]},
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
