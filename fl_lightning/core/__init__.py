"""The shared vocabulary: tensor dicts (params), per-client and server state (state), a round's
client tasks and results (tasks), who takes part (participation), the client-data and objective
contracts (client_data, objective, local_loss, client_rows), declared capabilities, local-training
settings (config), round metrics, known errors (errors) and the hub's one-line errors (hub).

May import: nothing of fl_lightning outside core.
"""
