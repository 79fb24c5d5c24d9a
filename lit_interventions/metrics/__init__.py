"""torchmetrics Metrics: their states sync across processes under DDP."""
