"""Mini-K3 factory: synthetic checkpoints, the corpus, the trainer, quality measures."""
