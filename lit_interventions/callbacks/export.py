"""Write the trained intervention next to the TensorBoard logs when fit ends: intervention.safetensors
and one card, config.json, with a README.md model card (the Hugging Face layout: the log directory
loads with `from_pretrained` and uploads with `push_to_hub`)."""

from __future__ import annotations

from lightning import Callback

from lit_interventions.artifacts.hub import export_dir, trainer_command
from lit_interventions.artifacts.intervention_files import save_run_intervention
from lit_interventions.core.files import finite_values
from lit_interventions.core.lm import num_layers
from lit_interventions.datamodules.base import BenchmarkDataModule
from lit_interventions.interventions.base import InterventionProtocol


def _site(site) -> dict:
    """A `Site` as config.json records it."""
    return {
        "layer": site.layer,
        "component": site.component,
        "position": site.position,
        **({"region": site.region} if site.region is not None else {}),
        **({"head": list(site.head) if isinstance(site.head, tuple) else site.head} if site.head is not None else {}),
    }


def _metrics(trainer) -> dict[str, float]:
    return dict(sorted(finite_values(trainer.callback_metrics).items()))


class ExportIntervention(Callback):
    """After fit, rank 0 writes `pl_module.intervention` through the intervention protocol
    (`save_run_intervention`: its tensors, and config.json with its class path and config and the
    run's model, site, data, metrics and command) and a README.md model card. Skipped when the
    module has no intervention, or one that exports no tensors."""

    def on_fit_end(self, trainer, pl_module):
        log_dir = trainer.log_dir or trainer.default_root_dir  # a collective under DDP: every rank asks
        intervention = getattr(pl_module, "intervention", None)
        if not trainer.is_global_zero or not isinstance(intervention, InterventionProtocol):
            return
        tensors = intervention.export()
        if not tensors:
            return
        data_hp = dict(trainer.datamodule.hparams) if trainer.datamodule is not None else {}
        hp = pl_module.hparams
        card = {
            "method": hp.get("method") or type(intervention).__name__,
            "model": hp.lm,
            "layer": hp.layer,
            "k": tensors["basis"].shape[0] if "basis" in tensors else None,
            "hidden_size": next(iter(tensors.values())).shape[-1],
            "data": {k: v for k, v in data_hp.items() if k != "lm" and not k.startswith("_")},  # not _class_path
            "metrics": _metrics(trainer),
            "command": trainer_command(trainer, log_dir),
        }
        if hp.get("component") not in (None, "block_output"):
            card["component"] = hp.get("component")
        if hp.get("head") is not None:
            card["head"] = hp.get("head")
        lm_config = getattr(getattr(pl_module, "lm", None), "config", None)
        if lm_config is not None:  # what `apply` checks an LM against
            card.update(num_layers=num_layers(lm_config), model_type=getattr(lm_config, "model_type", None))
        sites = getattr(pl_module, "sites", None)
        if sites:  # composed sites: one per part, in the parts' order
            card["site"] = {"sites": [_site(site) for site in sites]}
        if "task" in data_hp:  # CausalGym
            card.update(
                region=getattr(trainer.datamodule, "region", hp.get("region")),
                task=data_hp["task"],
                templates=data_hp.get("templates") or "builtin",
                control=data_hp.get("control"),
            )
        example = trainer.datamodule.usage_example() if isinstance(trainer.datamodule, BenchmarkDataModule) else None
        if example is not None:  # the model card's "Use" runs on it
            card["example"] = example
        directory = export_dir(trainer, log_dir)
        save_run_intervention(directory, intervention, card)
