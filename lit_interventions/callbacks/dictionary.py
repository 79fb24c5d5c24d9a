"""Write the trained concept dictionary next to the TensorBoard logs when fit ends."""

from __future__ import annotations

from lightning import Callback

from lit_interventions.artifacts.hub import export_dir, trainer_command


def _training_data(trainer) -> str:
    """What the dictionary was trained on: the data module's concept directory or data file
    (`concept_dir`, `path`), `builtin` for the built-in data, `unknown` without a data module."""
    datamodule = trainer.datamodule
    hp = getattr(datamodule, "hparams", {}) or {}
    return str(hp.get("concept_dir") or hp.get("path") or ("builtin" if datamodule is not None else "unknown"))


class ExportDictionary(Callback):
    """After fit, rank 0 writes `<log_dir>/dictionary.safetensors` (vectors, max activations) and one
    card, `config.json` (model, layer, the method's name and latent, concepts, hidden size, training
    data, val AUROC, command), with a `README.md` model card (`Dictionary.save_run`; the Hugging
    Face layout: the log directory loads with `Dictionary.from_pretrained` and uploads with `push_to_hub`).
    A module without `to_dictionary` (not a SteeringModule) is skipped, so the callback can sit in
    the CLI's defaults beside the DAS export."""

    def on_fit_end(self, trainer, pl_module):
        if not hasattr(pl_module, "to_dictionary"):  # another kind of module: nothing to export
            return
        log_dir = trainer.log_dir or trainer.default_root_dir  # a collective under DDP: every rank asks
        if not trainer.is_global_zero:
            return
        dictionary = pl_module.to_dictionary(training_data=_training_data(trainer))
        dictionary.card.setdefault("command", trainer_command(trainer, log_dir))
        directory = export_dir(trainer, log_dir)
        dictionary.save_run(directory)
