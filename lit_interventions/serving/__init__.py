"""The servers of `lit-interventions serve` and `serve-judge`. Their HTTP stack (uvicorn, h11,
Starlette) is the `serve` extra, not the base install: importing this package checks it first,
so a missing one is one line naming the extra (`lit_interventions.core.extras`)."""

from lit_interventions.core import extras

extras.require("serve", "lit-interventions serve / serve-judge", ("uvicorn", "starlette", "h11"))
