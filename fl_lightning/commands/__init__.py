"""The fl-lightning command: the subcommand dispatcher (cli; `python -m fl_lightning.commands.cli`),
`--import` of the user's own modules (user_modules) and the offline LoRA fixture (lora_fixture).

May import: everything.
"""
