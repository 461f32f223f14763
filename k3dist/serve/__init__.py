"""Serving runtime: EP model, rank-folder loader, server, warm-up, watchdog, deployment."""
