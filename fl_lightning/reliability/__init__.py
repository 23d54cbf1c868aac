"""Faults and recovery: simulated client faults and divergence checks (faults), streaming
checkpoint writes (checkpoint_io), a resume that continues its CSV log (csv_resume), what a resume
must share with its checkpoint (fingerprint), and SIGTERM/SIGINT ending a run with a checkpoint
(stopping).

May import: core.
"""
