"""The CausalGym sweep at the fine site components on a tiny model (`run_components`): a
component without heads (`mlp_neuron`, `block_input`) at every layer × region and a key/value
head component (`value`, grouped-query Llama: 2 key/value heads for 4 query heads) at every
layer × head × region each equal `train.py fit` at that site; the empty `head` column, the
summary and heatmaps without heads, resumption, bad input and the command line."""

import json

import pytest

import train
from lit_interventions.core import parts
from lit_interventions.core.lm import load_config
from lit_interventions.studies import causalgym_sweep as sweep
from tests.helpers import ONE_QUIET_EPOCH, csv_rows, run_command

REGIONS = ["The", "subject", "prep", "the", "object"]  # agr_sv_num_pp's
SIZES = dict(tasks="agr_sv_num_pp", train_pairs=10, eval_pairs=4, batch_size=64)
SWEPT = {"mlp_neuron": None, "block_input": None, "value": [0, 1]}  # component: its heads


def _sweep(lm, out, component, **kwargs):
    options = dict(methods=["das", "diffmean"], layers=[1], heads=SWEPT.get(component))
    return sweep.run_sweep(lm=lm, out=str(out), component=component, **SIZES, **{**options, **kwargs})


def _by_site(rows):
    return {(r["method"], int(r["layer"]), r["head"], r["region"]): float(r["odds"]) for r in rows}


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_lm_dir):
    """{component: (out, summary, rows)}: DAS and DiffMean at layer 1 of the tiny Llama."""
    found = {}
    for component in SWEPT:
        out = tmp_path_factory.mktemp(component) / "out"
        summary = _sweep(tiny_lm_dir("llama"), out, component)
        found[component] = out, summary, csv_rows(out / "results.csv")
    return found


def _fit(lm, tmp_path, component, head, method, region="object"):
    """`train.py fit` at (layer 1, component, head, region), its intervention scored on the eval
    split as the sweep scores it: its odds."""
    intervention = (
        []
        if method == "das"
        else [
            "--model.intervention=lit_interventions.interventions.fitted.DirectionInterchange",
            "--model.intervention.method=diffmean",
        ]
    )
    cli = train.main(
        args=[
            "fit",
            "--config",
            "configs/das.yaml",
            f"--model.lm={lm}",
            "--model.layer=1",
            f"--model.component={component}",
            *([] if head is None else [f"--model.head={head}"]),
            f"--model.region={region}",
            *intervention,
            "--data.train_pairs=10",
            "--data.eval_pairs=4",
            *ONE_QUIET_EPOCH,
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    return cli.model.score(list(cli.datamodule.loader("eval", 64)))["odds"]


@pytest.mark.parametrize("method", ["das", "diffmean"])
@pytest.mark.parametrize("component,head", [("mlp_neuron", None), ("block_input", None), ("value", 1)])
def test_a_sites_odds_equal_train_py_fit_there(swept, tiny_lm_dir, tmp_path, component, head, method):
    """The same computation as `train.py fit --model.component C [--model.head H]`, bit for bit;
    value's two key/value heads give different odds, so a mixed-up head index fails here."""
    odds = _by_site(swept[component][2])
    at = "" if head is None else str(head)
    if head is not None:
        assert odds[(method, 1, "0", "object")] != odds[(method, 1, "1", "object")]
    expected = _fit(tiny_lm_dir("llama"), tmp_path, component, head, method)
    assert odds[(method, 1, at, "object")] == expected
    assert abs(expected) > 1e-6  # a site where the intervention does something (not the exact 0 of `The`)


@pytest.mark.parametrize("component", ["mlp_neuron", "block_input"])
def test_a_component_without_heads_has_an_empty_head_column_and_the_layer_by_region_outputs(swept, component):
    out, summary, rows = swept[component]
    assert list(rows[0]) == ["task", "method", "layer", "head", "region", "odds", "iia", "control_odds", "control_iia"]
    assert set(_by_site(rows)) == {(m, 1, "", r) for m in ("das", "diffmean") for r in REGIONS}
    assert [line["method"] for line in summary] == ["das", "diffmean"] and "head" not in summary[0]
    odds = _by_site(rows)
    for line in summary:  # one layer: the overall odds is the best scored region's odds
        assert line["overall_odds"] == max(odds[(line["method"], 1, "", r)] for r in REGIONS[1:])
    written = csv_rows(out / "summary.csv")
    assert list(written[0]) == ["task", "method", "accuracy", "overall_odds", "selectivity"]
    assert [float(r["overall_odds"]) for r in written] == [line["overall_odds"] for line in summary]
    assert sorted(p.name for p in (out / "heatmaps").iterdir()) == [
        "agr_sv_num_pp_das.png",
        "agr_sv_num_pp_diffmean.png",
    ]
    assert all(p.stat().st_size > 1000 for p in (out / "heatmaps").iterdir())
    assert [p.name for p in (out / "das").glob("*.safetensors")] == ["agr_sv_num_pp_1.safetensors"]
    assert json.loads((out / "meta.json").read_text())["component"] == component


def test_a_key_value_component_is_swept_per_key_value_head(swept):
    out, summary, rows = swept["value"]
    assert {r["head"] for r in rows} == {"0", "1"}
    assert [(line["method"], line["head"]) for line in summary] == [
        ("das", 0),
        ("das", 1),
        ("diffmean", 0),
        ("diffmean", 1),
    ]
    assert (out / "heatmaps" / "agr_sv_num_pp_das_heads.png").is_file()
    assert json.loads((out / "meta.json").read_text())["component"] == "value"


def test_a_rerun_without_heads_scores_nothing_again(swept, tiny_lm_dir, tmp_path, monkeypatch):
    lm = tiny_lm_dir("llama")
    _sweep(lm, tmp_path / "out", "block_input", methods=["diffmean"])
    first = csv_rows(tmp_path / "out" / "results.csv")
    assert len(first) == len(REGIONS)
    monkeypatch.setattr(sweep, "sweep_site", lambda *a, **k: pytest.fail("rescored"))
    _sweep(lm, tmp_path / "out", "block_input", methods=["diffmean"])
    assert csv_rows(tmp_path / "out" / "results.csv") == first


@pytest.mark.parametrize(
    "component,heads,message",
    [
        (
            "mlp_neuron",
            [0],
            r"^heads=\[0\] is given with component='mlp_neuron', which has no heads: "
            r"heads is only for attention_head, query, key, value$",
        ),
        (
            "key",
            [1, 2],
            r"^heads \[2\] are out of range for component='key': this model has 2 key/value heads \(0\.\.1, or 'all'\)$",
        ),
        ("query", [4], r"^heads \[4\] are out of range for component='query': this model has 4 attention heads"),
    ],
)
def test_bad_heads_for_a_component_fail_before_any_model_work(
    tiny_lm_dir, tmp_path, monkeypatch, component, heads, message
):
    monkeypatch.setattr(sweep, "load_lm", lambda *a, **k: pytest.fail("the LM loaded"))
    with pytest.raises(ValueError, match=message):
        _sweep(tiny_lm_dir("llama"), tmp_path / "out", component, heads=heads)
    assert not (tmp_path / "out").exists()


def test_the_head_count_depends_on_the_component(tiny_lm_dir):
    config = load_config(tiny_lm_dir("llama"))  # 4 query heads, 2 key/value heads
    assert sweep.choose_heads("query", "all", config, [1]) == [0, 1, 2, 3]
    assert sweep.choose_heads("key", "all", config, [1]) == [0, 1]
    assert sweep.choose_heads("mlp_output", None, config, [0, 1]) == [None]
    assert sweep.choose_heads("block_output", None, config, [-1, 1]) is None
    with pytest.raises(ValueError, match=r"^layer -1 \(the embeddings\) has no block_input: choose layers 0\.\."):
        sweep.choose_heads("block_input", None, config, [-1, 1])


def test_a_component_the_architecture_lacks_is_one_line_before_any_sweep_work(tiny_lm_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(parts, "DOWN_PROJECTION", ("no_such_projection",))  # an MLP whose down projection is unknown
    monkeypatch.setattr(sweep, "sweep_site", lambda *a, **k: pytest.fail("swept"))
    with pytest.raises(
        ValueError, match=r"^Cannot find the down projection module of LlamaMLP: .*exactly one must\.$"
    ) as swept:
        _sweep(tiny_lm_dir("llama"), tmp_path / "out", "mlp_neuron", methods=["diffmean"])
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError) as fitted:  # the line `train.py fit` stops with there
        _fit(tiny_lm_dir("llama"), tmp_path / "fit", "mlp_neuron", None, "diffmean")
    assert str(swept.value) == str(fitted.value)


def test_a_directory_of_another_component_is_refused(swept, tiny_lm_dir):
    out, _, rows = swept["value"]
    with pytest.raises(
        ValueError, match=r'holds a sweep with --component="value", this run has --component="mlp_neuron"'
    ):
        _sweep(tiny_lm_dir("llama"), out, "mlp_neuron")
    assert csv_rows(out / "results.csv") == rows


def test_the_command_line_sweeps_mlp_neurons(tiny_lm_dir, tmp_path):
    out = tmp_path / "cli"
    done = run_command(
        "sweep",
        "causalgym",
        "--config",
        "configs/sweep_causalgym.yaml",
        f"--lm={tiny_lm_dir('gpt2')}",
        "--methods=[diffmean]",
        "--layers=[0,1]",
        "--train_pairs=10",
        "--eval_pairs=4",
        "--component=mlp_neuron",
        f"--out={out}",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-3].split() == ["task", "method", "accuracy", "overall_odds"]
    assert lines[-2].split()[:2] == ["agr_sv_num_pp", "diffmean"]
    assert lines[-1] == f"files in {out}"
    rows = csv_rows(out / "results.csv")
    assert {(r["layer"], r["head"]) for r in rows} == {("0", ""), ("1", "")}
    assert len(rows) == 2 * len(REGIONS)
    assert (out / "heatmaps" / "agr_sv_num_pp_diffmean.png").is_file()


def test_the_control_task_without_heads_gives_control_odds_and_selectivity(tiny_lm_dir, tmp_path):
    summary = _sweep(tiny_lm_dir("gpt_neox"), tmp_path / "out", "attention_output", methods=["diffmean"], control=True)
    rows = csv_rows(tmp_path / "out" / "results.csv")
    assert len(rows) == len(REGIONS) and all(r["control_odds"] != "" and r["head"] == "" for r in rows)
    assert [line["method"] for line in summary] == ["diffmean"]
    scored = [r for r in rows if r["region"] in REGIONS[1:]]
    assert summary[0]["selectivity"] == max(float(r["odds"]) - float(r["control_odds"]) for r in scored)
    assert summary[0]["selectivity"] != 0.0
