"""Privacy accounting of record-level DP-SGD with ``dp-accounting`` (docs/privacy.md, "Record-level DP-SGD";
docs/algorithms.md, equation (RDP.2)).

A record of client i is touched only in the local steps client i ran, so each client is accounted
on its own: after T_i local steps (every step of every round it took part in, stragglers' cut
budgets as run) its privacy loss is the T_i-fold composition of one step's event

* Poisson sampling (each record in the step's batch independently with probability q_i):
  ``PoissonSampledDpEvent(q_i, GaussianDpEvent(sigma))`` under add-or-remove-one record
  (the clipped sum's sensitivity is C);
* fixed-size sampling (B of the client's n_i records without replacement):
  ``SampledWithoutReplacementDpEvent(n_i, B, GaussianDpEvent(sigma / 2))`` under replace-one record
  (replacing a record moves the clipped sum by up to 2C).

``rdp`` composes Renyi DP at ``fl_lightning.pipeline.privacy_accounting.orders`` (dp-accounting's
default orders for Poisson sampling, integer orders without replacement; T_i times one step's curve:
the same floats however the steps were reached); ``pld`` self-composes one step's cached privacy loss
distribution T_i times (tighter; Poisson sampling only, see ``RecordAccountant``). The state
is the vector of step counts T: a resumed run restores it and reports the same epsilons, bit for bit.
"""

from __future__ import annotations

import math

import numpy as np

from fl_lightning.pipeline.privacy_accounting import _epsilon_from_rdp, _rdp_event, pld_poisson_epsilon


class RecordAccountant:
    """Every client's record-level epsilon after the local steps run so far.

    Args:
        sizes: n_i, each client's number of training records.
        rates: q_i, each client's per-step sampling probability (Poisson) or B / n_i (fixed-size).
        batch_size: B, the fixed batch size (``sampling="fixed"``; unused for Poisson).
        noise_multiplier: sigma (noise std / C).
        delta: the delta of the reported (epsilon, delta).
        sampling: ``"poisson"`` or ``"fixed"``.
        method: ``"rdp"`` or ``"pld"``.
    """

    def __init__(self, sizes, rates, batch_size: int, noise_multiplier: float, delta: float, sampling: str, method: str) -> None:
        if method == "pld" and sampling != "poisson":
            raise ValueError("record_privacy.accountant='pld' supports sampling='poisson' only (use accountant='rdp' for 'fixed')")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.rates = np.asarray(rates, dtype=np.float64)
        self.batch_size, self.sigma, self.delta = int(batch_size), float(noise_multiplier), float(delta)
        self.sampling, self.method = sampling, method
        self.steps = np.zeros(len(self.sizes), dtype=np.int64)  # T_i
        self._epsilon_cache: dict[tuple[float, int, int], float] = {}

    def add(self, clients, steps) -> None:
        """Account ``steps[j]`` more local steps of client ``clients[j]``."""
        np.add.at(self.steps, np.asarray(clients, dtype=np.int64), np.asarray(steps, dtype=np.int64))

    def _step_rdp(self, i: int) -> np.ndarray:
        """One step's RDP curve of client i (cached inside ``_rdp_event``)."""
        if self.sampling == "poisson":
            return _rdp_event("poisson", 0, 0, float(self.rates[i]), self.sigma)
        return _rdp_event("without_replacement", int(self.sizes[i]), self.batch_size, 0.0, self.sigma)

    def _epsilon(self, i: int, steps: int) -> float:
        key = (float(self.rates[i]), int(self.sizes[i]) if self.sampling == "fixed" else 0, steps)
        if key not in self._epsilon_cache:
            self._epsilon_cache[key] = self._compute(i, steps)
        return self._epsilon_cache[key]

    def _compute(self, i: int, steps: int) -> float:
        if steps == 0:
            return 0.0
        if self.sigma == 0:
            return math.inf
        if self.method == "rdp":
            kind = "poisson" if self.sampling == "poisson" else "without_replacement"
            return _epsilon_from_rdp(self._step_rdp(i) * steps, self.delta, kind)
        return pld_poisson_epsilon(float(self.rates[i]), self.sigma, steps, self.delta)

    def epsilons(self) -> np.ndarray:
        """Each client's epsilon at ``delta`` (0 for a client that never trained)."""
        return np.array([self._epsilon(i, int(t)) for i, t in enumerate(self.steps)])

    def metrics(self) -> dict[str, float]:
        """``privacy/record_epsilon`` (the worst client's) and the distribution over clients."""
        eps = self.epsilons()
        return {
            "privacy/record_epsilon": float(eps.max()),
            "privacy/record_epsilon_median": float(np.median(eps)),
            "privacy/record_epsilon_min": float(eps.min()),
            "privacy/record_steps_max": float(self.steps.max()),
        }
