"""Privacy accounting: RDP of DP-SGD, conversions, tuning bounds, calibration, the ledger rule.

Pure functions, no state: the ledger (``service/``) stores charges and recomputes a dataset's
totals through its :class:`Filter`.
"""

from core.accounting.calibration import calibrate_noise, solve_noise
from core.accounting.charges import Charge, charges_epsilon, trial_rdp
from core.accounting.filter import (
    PAIR_DELTA_SHARE,
    STATEMENT_DELTA_SHARE,
    Filter,
    filter_order,
)
from core.accounting.methods import (
    CAP_DELTA_SHARE,
    LT_DELTA2_SHARE,
    RANDOM_STOPPING,
    SINGLE,
    LiuTalwar,
    PapernotSteinke,
    Rdp,
    TrialMechanism,
    TuningMethod,
    tuning_epsilon,
    tuning_method,
)
from core.accounting.rdp import (
    ORDERS,
    compose,
    dpsgd_epsilon,
    epsilon_from_rdp,
    gaussian_rdp,
    rdp_curve,
    split_noise,
)
from core.accounting.tuning import (
    LiuTalwarBound,
    cap_delta,
    liu_talwar,
    ps_epsilon,
    trials_tail,
    tuning_rdp,
)

__all__ = [
    "CAP_DELTA_SHARE",
    "LT_DELTA2_SHARE",
    "ORDERS",
    "PAIR_DELTA_SHARE",
    "RANDOM_STOPPING",
    "SINGLE",
    "STATEMENT_DELTA_SHARE",
    "Charge",
    "Filter",
    "LiuTalwar",
    "LiuTalwarBound",
    "PapernotSteinke",
    "Rdp",
    "TrialMechanism",
    "TuningMethod",
    "calibrate_noise",
    "cap_delta",
    "charges_epsilon",
    "compose",
    "dpsgd_epsilon",
    "epsilon_from_rdp",
    "filter_order",
    "gaussian_rdp",
    "liu_talwar",
    "ps_epsilon",
    "rdp_curve",
    "solve_noise",
    "split_noise",
    "trial_rdp",
    "trials_tail",
    "tuning_epsilon",
    "tuning_method",
    "tuning_rdp",
]
