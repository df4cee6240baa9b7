"""The control plane's internal API as the runner sees it (``service.api.runner``)."""

from __future__ import annotations

from typing import Any

import httpx


class ControlPlaneError(RuntimeError):
    """The control plane answered a call with an error status."""

    def __init__(self, method: str, path: str, response: httpx.Response) -> None:
        super().__init__(
            f"control plane: {method} {path}: {response.status_code} {response.text[:500]}"
        )
        self.status = response.status_code


class AttemptRefused(Exception):
    """The job's reservation does not cover this attempt: it must not touch data."""


class ControlPlane:
    """Calls for one job, authenticated by its token; connection errors are retried."""

    def __init__(self, url: str, token: str, job_id: int, timeout_s: float = 60.0) -> None:
        self.base = f"{url.rstrip('/')}/internal/v1/jobs/{job_id}"
        self.http = httpx.Client(
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            transport=httpx.HTTPTransport(retries=5),
        )

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self.http.request(method, self.base + path, **kwargs)
        if not response.is_success:
            raise ControlPlaneError(method, path, response)
        return response

    def context(self) -> dict[str, Any]:
        """The admitted spec and plan, and the dataset as trials load it."""
        return self._call("GET", "").json()

    def start(self) -> None:
        """Mark the job running: a random-stopping job's bound is charged from here on."""
        self._call("POST", "/start")

    def start_attempt(self, index: int, params: dict[str, Any]) -> int:
        """Record (and charge) an attempt of trial ``index`` before it reads data."""
        try:
            response = self._call("POST", "/attempts", json={"index": index, "params": params})
        except ControlPlaneError as error:
            if error.status == httpx.codes.CONFLICT:  # not covered by the reservation
                raise AttemptRefused(str(error)) from None
            raise
        return int(response.json()["attempt"])

    def progress(self, attempt: int, steps: int, metrics: list[dict[str, Any]]) -> None:
        self._call(
            "POST", f"/attempts/{attempt}/progress", json={"steps": steps, "metrics": metrics}
        )

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

    def end(self, state: str, error: str | None = None) -> None:
        self._call("POST", "/end", json={"state": state, "error": error})
