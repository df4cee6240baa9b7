"""A Python client of the dptune API over HTTP (httpx). It imports neither torch, Ray, a
database driver nor the service: an analyst installs it beside their notebook.

>>> client = Client()                       # DPTUNE_URL, DPTUNE_API_KEY
>>> job = client.submit(spec)               # a dict, or a core.spec.JobSpec
>>> job.wait(progress=True).status
'released'
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from dptune.errors import DptuneError, api_error
from dptune.models import Budget, Dataset, JobView, Key, Logs, NewKey, Plan, Trial

DEFAULT_URL = "http://127.0.0.1:8000"


def _body(spec: Any) -> Any:
    """A job spec as JSON: a pydantic model (``core.spec.JobSpec``) dumped, a dict as is."""
    return spec.model_dump(mode="json") if isinstance(spec, BaseModel) else spec


class Client:
    """The API at ``url`` with the key ``key`` (defaults: ``DPTUNE_URL``, else
    http://127.0.0.1:8000, and ``DPTUNE_API_KEY``). Every error answer raises an
    :class:`~dptune.errors.ApiError` subclass naming the field at fault."""

    def __init__(self, url: str | None = None, key: str | None = None, timeout: float = 60) -> None:
        self.url = (url or os.environ.get("DPTUNE_URL") or DEFAULT_URL).rstrip("/")
        key = key or os.environ.get("DPTUNE_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **options: Any) -> httpx.Response:
        """``method path``; raises on an error answer or when the service cannot be reached."""
        try:
            response = self.http.request(method, path, **options)
        except httpx.HTTPError as error:
            raise DptuneError(f"cannot reach {self.url}: {error}") from None
        if response.is_error:
            try:
                body: Any = response.json()
            except ValueError:
                body = response.text
            raise api_error(response.status_code, body, response.headers.get("Retry-After"))
        return response

    def _json(self, method: str, path: str, **options: Any) -> Any:
        return self.request(method, path, **options).json()

    # datasets and budgets
    def datasets(self) -> list[Dataset]:
        return [Dataset.model_validate(d) for d in self._json("GET", "/v1/datasets")]

    def dataset(self, dataset_id: int) -> Dataset:
        return Dataset.model_validate(self._json("GET", f"/v1/datasets/{dataset_id}"))

    def budget(self, dataset_id: int) -> Budget:
        return Budget.model_validate(self._json("GET", f"/v1/datasets/{dataset_id}/budget"))

    # jobs
    def plan(self, spec: Any) -> Plan:
        """What ``spec`` would cost; nothing is reserved."""
        return Plan.model_validate(self._json("POST", "/v1/plans", json=_body(spec)))

    def submit(self, spec: Any, idempotency_key: str | None = None) -> Job:
        """Admit ``spec``, reserving its ε. A retry with the same ``idempotency_key`` returns
        the job admitted first instead of charging twice."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        view = self._json("POST", "/v1/jobs", json=_body(spec), headers=headers)
        return Job(self, JobView.model_validate(view))

    def job(self, job_id: int) -> Job:
        return Job(self, JobView.model_validate(self._json("GET", f"/v1/jobs/{job_id}")))

    def jobs(self, status: str | None = None, dataset: int | None = None) -> list[Job]:
        """The key's jobs (every job for an operator), newest first."""
        params = {k: v for k, v in {"status": status, "dataset": dataset}.items() if v}
        views = self._json("GET", "/v1/jobs", params=params)
        return [Job(self, JobView.model_validate(v)) for v in views]

    # keys (operators)
    def keys(self) -> list[Key]:
        return [Key.model_validate(k) for k in self._json("GET", "/v1/keys")]

    def create_key(self, name: str, role: str, datasets: list[int] | None = None) -> NewKey:
        """A new key; its ``secret`` is shown only here."""
        body = {"name": name, "role": role, "datasets": list(datasets or [])}
        return NewKey.model_validate(self._json("POST", "/v1/keys", json=body))

    def revoke_key(self, key_id: int) -> None:
        self.request("DELETE", f"/v1/keys/{key_id}")


class Job:
    """A submitted job: ``view`` is its last state read (:meth:`refresh` reads it again)."""

    def __init__(self, client: Client, view: JobView) -> None:
        self.client = client
        self.view = view

    def __repr__(self) -> str:
        return f"Job(id={self.id}, status={self.status!r})"

    @property
    def id(self) -> int:
        return self.view.id

    @property
    def status(self) -> str:
        return self.view.status

    def refresh(self) -> JobView:
        self.view = JobView.model_validate(self.client._json("GET", f"/v1/jobs/{self.id}"))
        return self.view

    def wait(
        self, progress: bool = False, timeout: float | None = None, poll_s: float = 2
    ) -> JobView:
        """Poll until the job ends (released, succeeded, failed or cancelled) and return its
        final view; :class:`DptuneError` after ``timeout`` seconds. ``progress``: a rich bar
        of the trials done, where the key may see them (not under random stopping)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._bar(progress) as show:
            while not self.refresh().done:
                show(self.view)
                if deadline is not None and time.monotonic() >= deadline:
                    raise DptuneError(f"job {self.id} still {self.status} after {timeout} s")
                time.sleep(poll_s)
            show(self.view)
        return self.view

    @contextmanager
    def _bar(self, enabled: bool) -> Iterator[Any]:
        if not enabled:
            yield lambda _: None
            return
        from rich.progress import Progress

        with Progress(transient=False) as bar:
            task = bar.add_task(f"job {self.id}", total=None)

            def show(view: JobView) -> None:
                total = view.progress.trials_total
                bar.update(
                    task,
                    description=f"job {self.id} {view.status}",
                    completed=view.progress.trials_done or 0,
                    total=total if isinstance(total, int) else None,
                )

            yield show

    def trials(self) -> list[Trial]:
        return [
            Trial.model_validate(t) for t in self.client._json("GET", f"/v1/jobs/{self.id}/trials")
        ]

    def cancel(self) -> JobView:
        """Ask the job to stop; ε already consumed is not refunded."""
        self.view = JobView.model_validate(self.client._json("POST", f"/v1/jobs/{self.id}/cancel"))
        return self.view

    def logs(self, offset: int = 0, limit: int = 1000) -> Logs:
        """The job's driver log (operators only)."""
        params = {"offset": offset, "limit": limit}
        return Logs.model_validate(
            self.client._json("GET", f"/v1/jobs/{self.id}/logs", params=params)
        )

    def download(self, path: str | Path) -> Path:
        """Write the released model (safetensors) to ``path``; :class:`Conflict` until a model
        is released."""
        return self._save(f"/v1/jobs/{self.id}/model", path)

    def report(self, path: str | Path) -> Path:
        """Write the job's trials and its dataset's budget as a PNG to ``path``."""
        return self._save(f"/v1/jobs/{self.id}/report.png", path)

    def _save(self, url: str, path: str | Path) -> Path:
        path = Path(path)
        path.write_bytes(self.client.request("GET", url).content)
        return path
