"""SyntaxGym evaluation: region surprisal of a frozen LM against each suite's predictions.

    lit-interventions syntaxgym --suites DIR_OR_FILES --lm NAME --out FILE

A suite (SyntaxGym JSON: `meta`, `predictions`, `items`) has items; an item has conditions; a
condition is a list of regions with `content`. A prediction is a formula over region
surprisals, e.g. `[(5;%reduced_ambig%) > (5;%unreduced_ambig%)] & [...]`, where
`(5;%reduced_ambig%)` is S(region 5 | condition reduced_ambig) in bits (see
`lit_interventions.core.surprisal` for how S is computed: `meta.metric` sum or mean).

    item correct    = 1 if every prediction holds for the item
    suite accuracy  = mean over the suite's items
    SG score        = mean over suites of the suite accuracy (31 of the 34 published suites, as
                      the official analysis; `SG score (all suites)` averages every suite)

One job a module:

    formulas.py   parse a prediction formula into a syntax tree and evaluate it (grammar there)
    suites.py     read and check a suite's JSON; find the suite files
    score.py      score items by region surprisal, suite accuracy, SG score, the CSV
    cli.py        the command line (`lit-interventions syntaxgym`, `lit-interventions syntaxgym`)
"""
