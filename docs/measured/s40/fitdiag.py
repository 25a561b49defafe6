# Diagnostic (session 40): serve with the step-cost fit's coefficients logged each period.
import logging, sys, numpy as np
from sluice.engine import admission as A
log = logging.getLogger("sluice.engine")
orig = A.StepCostModel.fixed_cost
def fixed_cost(self):
    f = orig(self)
    if len(self._y) >= self.MIN_STEPS:
        x, y = np.asarray(self._x), np.asarray(self._y)
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        pos = x[:, 1:].min(axis=0), x[:, 1:].max(axis=0)
        nn = [c for c in coef]
        log.info("FIT n=%d coef(ms: 1,row,prompt,pattn,dctx)=%s min=%s max=%s med_y=%.1fms fixed=%s",
                 len(y), np.round(np.asarray(coef) * 1e3, 3).tolist(), np.round(pos[0], 1).tolist(),
                 np.round(pos[1], 1).tolist(), float(np.median(y)) * 1e3, None if f is None else round(f * 1e3, 2))
    return f
A.StepCostModel.fixed_cost = fixed_cost
from sluice.cli import main
sys.exit(main(sys.argv[1:]))
