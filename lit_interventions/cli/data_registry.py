"""The published datasets `lit-interventions data` downloads: each a list of upstream files
pinned to one commit of the authors' repository, each with the sha256 of its bytes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Remote:
    """One upstream file: `path` below the dataset's base URL, saved as `name`.

    `members` (archives only): {file name in the archive: sha256}; those files are extracted flat
    into the output directory, and the archive itself is removed once they are checked.
    """

    path: str
    name: str
    sha256: str | None
    members: dict[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Dataset:
    name: str
    description: str
    base_url: str  # the files' `path`s are relative to it
    source: str  # the page a person opens to see where the files come from
    license: str
    files: tuple[Remote, ...]


def _github(repo: str, commit: str) -> str:
    return f"https://raw.githubusercontent.com/{repo}/{commit}/"


# ----------------------------------------------------------------------------- the registry
# Hashes: computed from the upstream repositories' files at the pinned commits (and equal to the
# copies this project was developed against). None: the file was too large to check here.

_SYNTAXGYM_COMMIT = "43f1f86b746254406dafc89bd17b9d4976607ef6"  # cpllab/syntactic-generalization
_SYNTAXGYM_SUITES = {
    "center_embed": "cc8b60e34eff4ec723a295d0378af07cceaf9bdccddd5a9508a1284e40d3390c",
    "center_embed_mod": "9688aebd2c4a8ff68ca25873fb9039304e3c70996488b74ffb69681dd236e8d7",
    "cleft": "b6e19bedec743fc8af079638d145e4af224efa4d671e403d2d7ff4a395d10713",
    "cleft_modifier": "d9823123e538ea8d3150c7f584881e1e7137339e9a136077d033c7cd5ae4f2a3",
    "fgd-embed3": "35db2d0535f2b4f896157149b3aa625e5fd08694480b4978fcc31a34156462ba",
    "fgd-embed4": "6933e47b9bc5e0635412bfa3dc89d44b34889e73f780f615ba6575dd069ab20b",
    "fgd_hierarchy": "ed5ddf73c04fc0bf577f6fcd4aef62b660b01c4fecb5b69216b1164128924693",
    "fgd_object": "64045162cd8158f07bcf9efc9b2ba9ad60324009f71bae8d58bb9a841e72eee5",
    "fgd_pp": "8baa56588f01f9807d465d910159ad0c89829a211088de88d8a9d2cb4df574ff",
    "fgd_subject": "bb641e69be1e4ad4d4077ceeb5fd86c87fcd1df69795b8654702bf7746386746",
    "mvrr": "5201adc7f9019caffc0bc54ca2d71db601f187d5a0dce55df0e90fd5592b2581",
    "mvrr_mod": "e6f7cea18cd1b5d22faaae0f2f9a08fecab53665dfc2926fabb1c6841637d2d2",
    "nn-nv-rpl": "7b06181fe8aa7cc6d3c3a224485b3023be2be638ca2ae16ef2dc1ee2c74d4dec",
    "npi_orc_any": "96f6bd4ab779633f4837132d2a17d89568e46b154a7052636da208ac360f7685",
    "npi_orc_ever": "7c69bb7c2d01df8107a650703ab12dfb900a09afb2d8e9c54da8ac82eaefd99d",
    "npi_src_any": "3ce002cc8a88beb0012dba511fff56edb60c58b5934275dbf4f8d36274505f75",
    "npi_src_ever": "cd7735f62dc7a301e0c48c825fb93b1824add388c7337954971f7da4bc2523f2",
    "npz_ambig": "2b46dd51f5985e62527e59e7f536656e28f462e33de9e3459cd635f73d5ca5e3",
    "npz_ambig_mod": "3cac79834de52d9cc4ff9b3ab0c8c8160cd9d602f1be2e503b6b622a4a2a582a",
    "npz_obj": "6852eddee888fce984dbe7734f90bfccd185e8b4d11affb8141434d5362b5cb6",
    "npz_obj_mod": "2c7d32dbf0167750510b6d7c30788665537210246024b30d9aa6545228ecb3bc",
    "number_orc": "b5c96cb8ed8306cc2c90f3bb65a4ba1c4d27c004bdb34855bfc7ec2973c934ac",
    "number_prep": "5c6a54fa244df2962b0700a2a6d6e03b8c0db8a1482cccfe64d16d01f8b3eeca",
    "number_src": "8c3a1db336d275fe7d10dac418450f83fc40c5456e94beb3a547ce314753f6df",
    "reflexive_orc_fem": "d18ce6a3a970b1356721ed8415e400b89020b5e0d76a3017d6be28689404b7b7",
    "reflexive_orc_masc": "03d31c93a4225e94decf38fe0c28cd01e869da2f209ae1ef7fb1d5c310323e7c",
    "reflexive_prep_fem": "e192369294f0780b1133349ec3d9a75532b0bce310ae50ddab9b2e2d394137e9",
    "reflexive_prep_masc": "81934e17431b72a553ab3a501471cb0b0eaa101ca7f78799abc48905a21f16ca",
    "reflexive_src_fem": "4e821bfd260762d996a72989fa350e64802e4f22e2188c0d5f58abcce2160a58",
    "reflexive_src_masc": "645ef6786dc63433c407de9d0085233df3b212579bef7b04f6e20493d37ec312",
    "subordination": "065fc960d7346cd96f152c389c36816bf330b415661319e7dc6022ff610855b4",
    "subordination_orc-orc": "91232f6eb5247b5fdccb399af642eb86411e099db2ba91b45b434401326a3497",
    "subordination_pp-pp": "e9eb380ba720048c4b6a503c23ccef2680db55bdd4093b41afb0d281ae0bb912",
    "subordination_src-src": "f0b84b08402fbde49b9e2ae07db0a3e663ff149a4dcffc4c8c931ef8bbc843a5",
}

_RAVEL_COMMIT = "e421fc9e132b3613b1d0020f856d539217fb30ca"  # explanare/ravel
_RAVEL_FILES = {
    "ravel_city_attribute_to_prompts.json": "4e40cb291cf532c6c8d3c764a3e9b46c2678120feb513055fab39ec51b66398a",
    "ravel_city_entity_attributes.json": "c3568f424f4c4349b85404be17f7671c36fd54945f4759ae533079cba9cd54fd",
    "ravel_city_entity_to_split.json": "9a1e0886b59d4313c153637ffdbeee9e403bce2dbdba8b59ff2a58b9049b842f",
    "ravel_city_prompt_to_split.json": "f805ec435d64673f0d4eff77b2c4a107abbd2a55df19543876a7e2b0feba352c",
    "ravel_nobel_prize_winner_attribute_to_prompts.json": "fad17ac4c798e4d5412591afd4c06a20f1cde930b53ded199f5e27ab21656f2d",
    "ravel_nobel_prize_winner_entity_attributes.json": "2a4d66328011bb2c63abc6434446236ccb0da73c727c2f68ea12447277f81c6f",
    "ravel_nobel_prize_winner_entity_to_split.json": "066e470ee344a4836f87d2f680ab13850ed1bcba86a788d6e20fa6d4abd80f45",
    "ravel_nobel_prize_winner_prompt_to_split.json": "ac070b66540acc9fbca5fc13e8fe612d7c32a9d99940c1e6e93bf4de0ed60982",
    "ravel_occupation_attribute_to_prompts.json": "59bd9bd6613512c9172c7b1871c85a10e4eeea1dc77f97510b241c9545ac45e8",
    "ravel_occupation_entity_attributes.json": "b670c6f2f521b19ef5d62e55a1380ec5ff046c14cfa72fdd440c07dde7d01066",
    "ravel_occupation_entity_to_split.json": "fe137fa81baa27b91855abc8730855b070ee880c3be6659fd3c1c11df2165b86",
    "ravel_occupation_prompt_to_split.json": "78b336530d354cc25ce29caaae1e4534765de2c15918a0db9d532174e3739296",
    "ravel_physical_object_attribute_to_prompts.json": "f84547c0c3478fe5f966aaafdf3601b1eef6e6326070fa735083f151800d8de9",
    "ravel_physical_object_entity_attributes.json": "672584e27d5027e9ff3391d33a72e69ccdde1cadbf15260a277e1084dd5d1b7a",
    "ravel_physical_object_entity_to_split.json": "d085553d2dd8377e7ef502c7cf7033fe6c9ff614933bb85ca6bd6147c3c128b6",
    "ravel_physical_object_prompt_to_split.json": "9f87c9e2079636d990b64ab08e294d16bbc37d87c1290be4b2217357db1062f0",
    "ravel_verb_attribute_to_prompts.json": "e7fa54f8d3e2bd865b8821bff33976d69ac12cebb661f7a13314221636b719ee",
    "ravel_verb_entity_attributes.json": "309c015a1e14fc32090d16b48ff3634d7e627cd7a2a055ea879070db97d10347",
    "ravel_verb_entity_to_split.json": "4ebfadc203a3e3098d9a8ce680d7185acc78fc0e66124a0391424c22805b565d",
    "ravel_verb_prompt_to_split.json": "dac8e8d38bd1fb6c1d8a5a4efeb1ad011b17589a9b4d1686b6be6ba6bcac4d6f",
    "wikipedia_city_entity_prompts.json": "0b27cc890efbaf62ef5292fcb9f157c170685a0d8930327dc4e8f8b5a4f8722f",
    "wikipedia_nobel_prize_winner_entity_prompts.json": "0b98d65358cc779bcf67c3a5dc065795521a9e8ed303f72159d33af18d05d4a2",
    "wikipedia_occupation_entity_prompts.json": "9232b746f18d8cf7ad1da1d0662e5f3ce7e8dfb3509f2e5af32043f00710a612",
    "wikipedia_physical_object_entity_prompts.json": "821e4c4aeadf1faa0a1df1708c50df7b87e4cf44684793fc0b4d691c6225dcbf",
    "wikipedia_verb_entity_prompts.json": "f599f546ff76f4ec59e831042d4026747aa7ebfaeb7e747c94a0f5bf6e9ba462",
}

_AXBENCH_COMMIT = "e9b8cd4783c983e350d78af76f3fb2b8b15fc7d3"  # stanfordnlp/axbench
_AXBENCH_LICENSE = Remote("LICENSE", "LICENSE", "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4")

DATASETS: dict[str, Dataset] = {
    d.name: d
    for d in (
        Dataset(
            name="causalgym",
            description="CausalGym's 29 task templates (Arora et al. 2024), for --data.templates",
            base_url=_github("aryamanarora/causalgym", "0f3129ff3b6c5c8264892f30a25be25150ae9179"),
            source="https://github.com/aryamanarora/causalgym (data/templates/syntaxgym.json)",
            license="no license file in the repository; cite the paper",
            files=(
                Remote(
                    "data/templates/syntaxgym.json",
                    "templates.json",
                    "49d557b5970b7c6bad69d63d14399d19827751c993f1318c2633df2dd3e494a4",
                ),
            ),
        ),
        Dataset(
            name="syntaxgym",
            description="the 34 SyntaxGym test suites of Hu et al. 2020, for `syntaxgym --suites`",
            base_url=_github("cpllab/syntactic-generalization", _SYNTAXGYM_COMMIT),
            source="https://github.com/cpllab/syntactic-generalization/tree/master/test_suites/json",
            license="MIT",
            files=(
                *(Remote(f"test_suites/json/{s}.json", f"{s}.json", h) for s, h in _SYNTAXGYM_SUITES.items()),
                Remote(
                    "test_suites/README.md",
                    "README.upstream.md",
                    "a95084c62bed5f5cdd97f809cfb6b9b952403a76843e2afd66d407e1d958cd4d",
                ),
                Remote("LICENSE", "LICENSE", "58349ba6415bab546a8937e45a42ed2be94c368d36d0603bd2d12c37a203124f"),
            ),
        ),
        Dataset(
            name="ravel",
            description="RAVEL entities, prompts and splits, 5 entity types (Huang et al. 2024), for --data.ravel_dir",
            base_url=_github("explanare/ravel", _RAVEL_COMMIT),
            source="https://github.com/explanare/ravel (data.tgz)",
            license="MIT",
            files=(
                Remote(
                    "data.tgz",
                    "data.tgz",
                    "b148f0ded1979cb0e17e301cfda41cb120517a109d3c758cc768e376946d96bc",
                    members=dict(_RAVEL_FILES),
                ),
                Remote("LICENSE", "LICENSE", "20fb6d10ba6b0db267dc9166b9bfb4b38aa7cc2907ede5fa3b6a761e7f852663"),
            ),
        ),
        Dataset(
            name="axbench-concept10",
            description="AxBench Concept10, Gemma-2-2B layer 20 (Wu et al. 2025), for --data.concept_dir",
            base_url=_github("stanfordnlp/axbench", _AXBENCH_COMMIT),
            source="https://github.com/stanfordnlp/axbench/tree/main/axbench/concept10/prod_2b_l20_v1 "
            "(also on the hub: https://huggingface.co/datasets/pyvene/axbench-concept10)",
            license="Apache-2.0",
            files=(
                Remote(
                    "axbench/concept10/prod_2b_l20_v1/generate/train_data.parquet",
                    "train_data.parquet",
                    "9483c9934bc51882049f88f90bc3d4ebd9ffbcb4bf049623063cacf51407dfc4",
                ),
                Remote(
                    "axbench/concept10/prod_2b_l20_v1/inference/latent_eval_data.parquet",
                    "latent_eval_data.parquet",
                    "39d9d3c8dac118250d0cca5b5386397c29539b4ead42ccd00394e5e362102178",
                ),
                Remote(
                    "axbench/concept10/prod_2b_l20_v1/generate/metadata.jsonl",
                    "metadata.jsonl",
                    "b3d23061a242ebe586f3b9d63551a9562d25d9f330332002aba69416cb20c320",
                ),
                _AXBENCH_LICENSE,
            ),
        ),
        Dataset(
            name="axbench-concept500",
            description="AxBench Concept500, Gemma-2-2B layer 20 (Wu et al. 2025), for --data.concept_dir",
            base_url=_github("stanfordnlp/axbench", _AXBENCH_COMMIT),
            source="https://github.com/stanfordnlp/axbench/tree/main/axbench/concept500/prod_2b_l20_v1 "
            "(also on the hub: https://huggingface.co/datasets/pyvene/axbench-concept500)",
            license="Apache-2.0",
            files=(
                Remote("axbench/concept500/prod_2b_l20_v1/generate/train_data.parquet", "train_data.parquet", None),
                Remote(
                    "axbench/concept500/prod_2b_l20_v1/inference/latent_eval_data.parquet",
                    "latent_eval_data.parquet",
                    None,
                ),
                Remote(
                    "axbench/concept500/prod_2b_l20_v1/generate/metadata.jsonl",
                    "metadata.jsonl",
                    "435aad14e202402b0989d62b279f63dfc63aa2aff0e488cf62652c0700a1efdc",
                ),
                _AXBENCH_LICENSE,
            ),
        ),
    )
}


def get_dataset(name: str) -> Dataset:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}")
    return DATASETS[name]
