"""The fixed admission filters by name (what a config's ``admission`` string builds).

``always`` and ``second-offer`` are in :mod:`kvstrata.logical.admission`, ``predicted-reuse``
in :mod:`kvstrata.logical.reuse_prediction`; ``adaptive`` is the duel's
(:mod:`kvstrata.logical.adaptive`). :mod:`kvstrata.logical.policy` builds a tier's policies.
"""

from __future__ import annotations

from typing import Callable

from .admission import AdmissionPolicy, SecondOfferAdmission
from .reuse_prediction import PredictedReuseAdmission

__all__ = ["ADMISSION_FILTERS"]

ADMISSION_FILTERS: dict[str, Callable[[int], AdmissionPolicy]] = {
    "always": lambda capacity: AdmissionPolicy(),
    "second-offer": SecondOfferAdmission,
    "predicted-reuse": PredictedReuseAdmission,
}
"""The fixed admission filters by name; each is built from the tier's capacity."""
