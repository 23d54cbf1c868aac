"""The round loop on Lightning: FederatedModule, one training step = one federated round
(module; async_step: its FedBuff/FedAsync step), and the evaluation callbacks that read it (callbacks, personal_eval, instruction_eval).

May import: core, reliability, optim, algorithms, executors, pipeline, compression, clock.
"""
