"""The round loop on Lightning: FederatedModule, one training step = one federated round
(module), and the evaluation callbacks that read it (callbacks, personal_eval, instruction_eval).

May import: core, reliability, optim, algorithms, executors, pipeline, compression.
"""
