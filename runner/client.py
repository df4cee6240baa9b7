"""The control plane's internal API as the runner sees it (``service.api.runner``)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import httpx

log = logging.getLogger("dptune.control")

#: an attempt's progress goes to the control plane at most this often (s); see :class:`Progress`
PROGRESS_EVERY_S = 1.0

#: answers of a proxy in front of a control plane that is restarting
_UNAVAILABLE = {
    httpx.codes.BAD_GATEWAY,
    httpx.codes.SERVICE_UNAVAILABLE,
    httpx.codes.GATEWAY_TIMEOUT,
}


class ControlPlaneError(RuntimeError):
    """The control plane answered a call with an error status."""

    def __init__(self, method: str, path: str, response: httpx.Response) -> None:
        super().__init__(
            f"control plane: {method} {path}: {response.status_code} {response.text[:500]}"
        )
        self.status = response.status_code


class AttemptRefused(Exception):
    """The job's reservation does not cover this attempt: it must not touch data."""


def _finite_or_null(value: Any) -> Any:
    """``value``, or None where it is a float that JSON cannot carry (NaN, ±inf)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class ControlPlane:
    """Calls for one job, authenticated by its token.

    A call the control plane did not answer — no connection (it is restarting), a connection
    dropped mid-call, a proxy's 502/503/504 — is retried with exponential backoff for up to
    ``patience_s``, so that a restart of the service does not fail the trials of a running
    job. A retried call may have landed before its answer was lost; the API makes that
    harmless: ending an attempt, failing open attempts, the job's start and end, and the model
    upload count once, and a second attempt row only adds a charge (it ends, failed, with the
    job)."""

    def __init__(
        self,
        url: str,
        token: str,
        job_id: int,
        timeout_s: float = 60.0,
        patience_s: float = 300.0,
    ) -> None:
        self.base = f"{url.rstrip('/')}/internal/v1/jobs/{job_id}"
        self.patience_s = patience_s
        self.http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        deadline = time.monotonic() + self.patience_s
        delay = 0.5
        while True:
            try:
                response = self.http.request(method, self.base + path, **kwargs)
                if response.status_code not in _UNAVAILABLE:
                    break
                failure: Exception = ControlPlaneError(method, path, response)
            except httpx.TransportError as error:
                failure = error
            if time.monotonic() + delay > deadline:
                raise failure
            log.warning("%s %s: %s; retrying in %.1f s", method, path, failure, delay)
            time.sleep(delay)
            delay = min(2 * delay, 5.0)
        if not response.is_success:
            raise ControlPlaneError(method, path, response)
        return response

    def context(self) -> dict[str, Any]:
        """The admitted spec and plan, and the dataset as trials load it."""
        return self._call("GET", "").json()

    def start(self) -> None:
        """Mark the job running: a random-stopping job's bound is charged from here on."""
        self._call("POST", "/start")

    def start_attempt(self, index: int, params: dict[str, Any], node: str | None = None) -> int:
        """Record (and charge) an attempt of trial ``index``, running on Ray node ``node``,
        before it reads data."""
        body = {"index": index, "params": params, "node": node}
        try:
            response = self._call("POST", "/attempts", json=body)
        except ControlPlaneError as error:
            if error.status == httpx.codes.CONFLICT:  # not covered by the reservation
                raise AttemptRefused(str(error)) from None
            raise
        return int(response.json()["attempt"])

    def progress(self, attempt: int, steps: int, metrics: list[dict[str, Any]]) -> None:
        """Record metric rows; a value that is not a finite number is sent as null (JSON has no
        NaN or ±inf): a value computed on private data must not be able to fail the call, and
        with it the trial (docs/design.md, invariant 13)."""
        rows = [{k: _finite_or_null(v) for k, v in row.items()} for row in metrics]
        self._call("POST", f"/attempts/{attempt}/progress", json={"steps": steps, "metrics": rows})

    def finish(
        self,
        attempt: int,
        status: str,
        steps: int,
        score: float | None = None,
        thresholds: list[float] | None = None,
    ) -> None:
        self._call(
            "POST",
            f"/attempts/{attempt}/finish",
            json={"status": status, "steps": steps, "score": score, "thresholds": thresholds},
        )

    def fail_open(self, index: int) -> None:
        """Trial ``index``'s process died: fail its attempts that never reported an end."""
        self._call("POST", f"/trials/{index}/fail-open")

    def upload_model(self, index: int, weights: bytes) -> None:
        """Release trial ``index``'s weights (safetensors); the control plane checks that it is
        the job's best finished trial."""
        self._call(
            "PUT",
            f"/trials/{index}/model",
            content=weights,
            headers={"content-type": "application/octet-stream"},
        )

    def end(self, state: str, error: str | None = None) -> tuple[float, float]:
        """Settle the job; what it was charged: ε of its charges composed, at its δ."""
        charged = self._call("POST", "/end", json={"state": state, "error": error}).json()
        return float(charged["epsilon"]), float(charged["delta"])

    def hold_left(self) -> float:
        """Seconds the job still keeps its cluster resources (``privacy.hold_release``)."""
        return float(self._call("GET", "/hold").json()["seconds"])


class Progress:
    """An attempt's progress for the control plane, batched: epochs' metric rows are sent with
    the steps run so far at the first epoch, then at most every ``every_s`` seconds, and what
    is left by :meth:`flush` before the attempt ends. Each call is a write the control plane
    commits, milliseconds each: one an epoch would be a sizeable share of a short trial's
    time."""

    def __init__(self, api: ControlPlane, attempt: int, every_s: float = PROGRESS_EVERY_S) -> None:
        self.api, self.attempt, self.every_s = api, attempt, every_s
        self.rows: list[dict[str, Any]] = []
        self.steps = 0
        self.sent_at = -math.inf

    def add(self, steps: int, rows: list[dict[str, Any]]) -> bool:
        """Record an epoch's rows; whether they were sent now (with any held back)."""
        self.steps = steps
        self.rows += rows
        if time.monotonic() - self.sent_at < self.every_s:
            return False
        self.flush()
        return True

    def flush(self) -> None:
        """Send the rows held back, if any (once: rows whose call failed are not sent again)."""
        rows, self.rows = self.rows, []
        self.sent_at = time.monotonic()
        if rows:
            self.api.progress(self.attempt, self.steps, rows)
