"""Studies made of runs: sweeps and comparisons (sweep, compare, their tables and plots, the
logged history they read), Monte Carlo studies (montecarlo), partition plots (partition_plot) and
the checks of a user's own algorithm (testing).

May import: run and everything below it.
"""
