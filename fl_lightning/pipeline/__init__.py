"""The message pipeline between clients and server: composable stages over uploads and
broadcasts (messages), client-level differential privacy as stages (privacy) and its accounting
(privacy_accounting). The compression stages are fl_lightning.compression.

May import: core, optim, algorithms, executors.
"""
