"""torchmetrics Metrics: their states sync across processes under DDP."""

from lit_interventions.metrics.odds import InterchangeOdds, log_odds_ratio

__all__ = ["InterchangeOdds", "log_odds_ratio"]
