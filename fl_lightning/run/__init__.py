"""One run from its settings: the LightningCLI of fit/validate/test/predict (cli_app), config
files and their bases (config_files, bundled_configs), one-line config errors (config_errors), the
start of DDP ranks (launch), torch threads (threads), what a run prints (terminal) and the export
of the global model (export).

May import: the engine and everything below it, models, datamodules.
"""
