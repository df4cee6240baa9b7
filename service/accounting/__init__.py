"""Privacy accounting: RDP of DP-SGD, conversions, tuning bounds, calibration, the ledger rule.

Pure functions, no state: the ledger (``service/``) stores charges and recomputes totals with
:func:`dataset_epsilon`.
"""

from service.accounting.calibration import calibrate_noise
from service.accounting.jobs import (
    METHODS,
    Charge,
    dataset_epsilon,
    job_charge,
    job_epsilon,
    trial_rdp,
    tuning_epsilon,
)
from service.accounting.rdp import (
    ORDERS,
    compose,
    dpsgd_epsilon,
    epsilon_from_rdp,
    gaussian_rdp,
    rdp_curve,
    split_noise,
)
from service.accounting.tuning import (
    LiuTalwarBound,
    cap_delta,
    liu_talwar,
    ps_epsilon,
    trials_tail,
    tuning_rdp,
)

__all__ = [
    "METHODS",
    "ORDERS",
    "Charge",
    "LiuTalwarBound",
    "calibrate_noise",
    "cap_delta",
    "compose",
    "dataset_epsilon",
    "dpsgd_epsilon",
    "epsilon_from_rdp",
    "gaussian_rdp",
    "job_charge",
    "job_epsilon",
    "liu_talwar",
    "ps_epsilon",
    "rdp_curve",
    "split_noise",
    "trial_rdp",
    "trials_tail",
    "tuning_epsilon",
    "tuning_rdp",
]
